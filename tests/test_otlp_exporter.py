"""The ``otlp`` and ``otlp-traces`` exporters: observation records exported as log records, and attempts
as spans, through OpenTelemetry's OTLP/HTTP exporters to a real HTTP endpoint on loopback, which decodes
the protobuf requests (``runlane_otlp.testing``)."""

from __future__ import annotations

import asyncio

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from runlane_local import local_lane
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
from runlane_otlp import opentelemetry_sink, otlp_sink, otlp_trace_sink
from runlane_otlp.sink import DEFAULT_LOGS_ENDPOINT, DEFAULT_TRACES_ENDPOINT
from runlane_otlp.testing import OtlpTestReceiver

from runlane import CancellationController, ErrorCode, Retry, RunlaneError, TaskContext, create_runlane, queue, task
from runlane.testing import ControlledClock
from runlane.vocabulary import RunlaneObservationExporterTickStatus as Tick

T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"

default = queue("default", default=True)
attempts: dict[str, int] = {}


@task("reports.build", retry=Retry(max_attempts=2))
async def build(payload: dict[str, Any], ctx: TaskContext) -> dict[str, Any]:
    await ctx.step.run("fetch", lambda step: {"rows": 3})
    attempts[ctx.run_id] = attempts.get(ctx.run_id, 0) + 1
    if attempts[ctx.run_id] == 1:
        raise RuntimeError("the warehouse timed out")
    return {"rows": 3}


@task("emails.send")
async def send(payload: dict[str, Any]) -> None:
    return None


def runtime_and_clock() -> tuple[Any, ControlledClock]:
    clock = ControlledClock(T0)
    return create_runlane(lane=local_lane(), queues=[default], tasks=[build, send], clock=clock), clock


async def drain_exporter(exporter: Any) -> list[Any]:
    ticks = []
    for _ in range(20):
        tick = await exporter.export_once()
        ticks.append(tick.status)
        if tick.status is not Tick.EXPORTED:
            break
    return ticks


async def test_each_attempt_is_a_span_under_the_trace_that_triggered_the_run() -> None:
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_trace_sink(endpoint=receiver.traces_endpoint, service_name="billing-workers")
        async with runtime:
            run = (await runtime.trigger(build, {}, trace_carrier={"traceparent": TRACEPARENT})).run
            clock.advance(timedelta(seconds=1))
            await runtime.execute_next()  # attempt 1 fails, a retry is scheduled
            clock.advance(timedelta(minutes=5))
            await runtime.tick()
            await runtime.execute_next()  # attempt 2 succeeds
            assert await drain_exporter(runtime.observation_exporter("tracing", sink)) == [Tick.EXPORTED, Tick.IDLE]

    first, second = sorted(receiver.spans, key=lambda span: span.attributes["runlane.attempt"])
    for span in (first, second):
        assert span.name == "reports.build"
        assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)
        assert span.kind == 5  # SPAN_KIND_CONSUMER
        assert span.resource["service.name"] == "billing-workers"
        assert span.attributes["runlane.run_id"] == run.id and span.attributes["messaging.system"] == "runlane"
    assert first.attributes["runlane.outcome"] == "retry_scheduled"
    assert first.attributes["runlane.failure_code"] == "task_failed"
    assert (first.status_code, first.status_message) == (2, "task_failed")  # STATUS_CODE_ERROR
    # The step ran in attempt 1; attempt 2 replayed its stored output, so only the first span shows it.
    assert [(name, attributes) for name, _, attributes in first.events] == [
        ("runlane.step", {"runlane.step_key": "fetch"})
    ]
    assert second.events == []
    assert second.attributes["runlane.outcome"] == "succeeded" and second.status_code == 1  # STATUS_CODE_OK
    # Triggered at T0, started 1 s later; the retry was requested by the tick and started at once.
    assert [first.attributes["runlane.queue_wait_ms"], second.attributes["runlane.queue_wait_ms"]] == [1000, 0]
    assert second.start_time == int((T0 + timedelta(minutes=5, seconds=1)).timestamp() * 1e9)
    assert first.span_id != second.span_id


async def test_without_a_traceparent_the_attempts_of_a_run_share_a_trace_of_their_own() -> None:
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            runs = [(await runtime.trigger(send, {"n": n})).run for n in range(2)]
            await runtime.execute_next()
            await runtime.execute_next()
            sink = otlp_trace_sink(endpoint=receiver.traces_endpoint)
            await drain_exporter(runtime.observation_exporter("tracing", sink))
    by_run = {span.attributes["runlane.run_id"]: span for span in receiver.spans}
    assert set(by_run) == {run.id for run in runs}
    assert all(span.parent_span_id == "" for span in by_run.values())
    assert len({span.trace_id for span in by_run.values()}) == 2


async def test_a_refused_batch_keeps_the_checkpoint_and_is_sent_again_with_the_same_span_ids() -> None:
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_trace_sink(endpoint=receiver.traces_endpoint, timeout=2)
        async with runtime:
            await runtime.trigger(build, {})
            clock.advance(timedelta(seconds=1))
            exporter = runtime.observation_exporter("tracing", sink, batch_size=4)
            await runtime.execute_next()  # attempt 1: a step, then a retry
            # The first batch (created .. started) opens the attempt; the batch that ends it is refused.
            assert await exporter.export_once() and receiver.spans == []
            receiver.fail_next(1, status=500)  # a status the OTLP exporter does not retry by itself
            tick = await exporter.export_once()
            assert tick.status is Tick.FAILED
            assert isinstance(tick.error, RunlaneError) and tick.error.code is ErrorCode.OBSERVATION_EXPORT_FAILED
            assert tick.error.retryable and tick.error.meta["http_status"] == 500
            assert "HTTP 500" in tick.error.message

            assert await drain_exporter(exporter) == [Tick.EXPORTED, Tick.IDLE]
            (span,) = receiver.spans
            # Sent again, the span is whole: its start, queue wait and step were not lost with the refusal.
            assert "runlane.start_unknown" not in span.attributes
            assert span.attributes["runlane.queue_wait_ms"] == 1000
            assert [name for name, _, _ in span.events] == ["runlane.step"]
            # The stream is at least once: sending the same records again gives the same span.
            again = otlp_trace_sink(endpoint=receiver.traces_endpoint)
            page = await runtime.observations.scan()
            await again.export(page.records)
    assert [s.span_id for s in receiver.spans] == [span.span_id, span.span_id]


@pytest.mark.parametrize("status", [400, 401, 404, 413])
async def test_a_batch_the_endpoint_refuses_for_good_stops_the_exporter_naming_the_status(status: int) -> None:
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_sink(endpoint=receiver.logs_endpoint, timeout=2)
        async with runtime:
            await runtime.trigger(send, {})
            receiver.fail_next(1, status=status)
            with pytest.raises(RunlaneError) as raised:
                await runtime.observation_exporter("logs", sink).run(retry_delay="10ms", idle_delay="10ms")
            assert raised.value.code is ErrorCode.OBSERVATION_EXPORT_FAILED and not raised.value.retryable
            assert f"with HTTP {status}" in raised.value.message and raised.value.meta["http_status"] == status
            assert await runtime.observations.checkpoint("logs") is None
            assert receiver.requests == 1  # not sent again and again


async def test_an_endpoint_asking_to_retry_later_is_retried_no_sooner() -> None:
    """A 429 with Retry-After: the failure says how long, and the exporter loop waits that long (not its
    shorter retry_delay) before it sends the batch again."""
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_sink(endpoint=receiver.logs_endpoint, timeout=1)
        async with runtime:
            await runtime.trigger(send, {})
            receiver.fail_next(10, status=429, retry_after="120")
            exporter = runtime.observation_exporter("logs", sink)
            tick = await exporter.export_once()
            assert tick.status is Tick.FAILED and isinstance(tick.error, RunlaneError) and tick.error.retryable
            assert tick.error.meta["http_status"] == 429 and tick.error.meta["retry_after_s"] == 120
            assert "once the 120 s it asked for (Retry-After) have passed" in tick.error.message
            controller = CancellationController()
            looping = asyncio.ensure_future(exporter.run(signal=controller.signal, retry_delay="10ms"))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if receiver.requests > 1 and looping.done() is False:
                    break
            sent = receiver.requests
            await asyncio.sleep(0.3)  # 30 retry_delays
            assert receiver.requests == sent  # waiting out the 120 s it asked for
            controller.abort("test over")
            await asyncio.wait_for(looping, 5)


SECRET = "card 4111-1111-1111-1111"


async def test_a_batch_delivered_again_after_it_was_accepted_yields_the_same_spans() -> None:
    # A checkpoint advance that fails after the endpoint accepted a batch (a storage outage at that moment)
    # delivers the batch again: its spans went out again under the same ids without their start and steps,
    # as attempts that had started before the exporter was watching.
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_trace_sink(endpoint=receiver.traces_endpoint)
        async with runtime:
            await runtime.trigger(build, {}, trace_carrier={"traceparent": TRACEPARENT})
            clock.advance(timedelta(seconds=1))
            await runtime.execute_next()  # attempt 1 fails, a retry is scheduled
            clock.advance(timedelta(minutes=5))
            await runtime.tick()
            await runtime.execute_next()  # attempt 2 succeeds
            records = (await runtime.observations.scan()).records
        middle = next(i for i, r in enumerate(records) if r.observation.event_type == "run.retry_scheduled")
        first, second = records[: middle - 1], records[middle - 1 :]  # attempt 1's step is in the second batch
        for batch in (first, second, second):
            await sink.export(batch)
        sink.close()
    assert len(receiver.spans) == 2  # the batch was accepted the first time: it is not sent twice
    for span in receiver.spans:
        assert "runlane.start_unknown" not in span.attributes
    attempt_1 = next(span for span in receiver.spans if span.attributes["runlane.attempt"] == 1)
    assert [name for name, _, _ in attempt_1.events] == ["runlane.step"]


async def test_every_observation_record_is_a_log_record_in_the_trace_that_triggered_the_run() -> None:
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_sink(
            endpoint=receiver.logs_endpoint,
            service_name="billing-workers",
            resource_attributes={"service.namespace": "jobs"},
        )
        async with runtime:
            traced = (await runtime.trigger(build, {"note": SECRET}, trace_carrier={"traceparent": TRACEPARENT})).run
            plain = (await runtime.trigger(send, {"note": SECRET})).run
            clock.advance(timedelta(seconds=1))
            await runtime.execute_next()  # traced, attempt 1: the step completes, then a retry is scheduled
            await runtime.execute_next()  # plain succeeds
            clock.advance(timedelta(minutes=5))
            await runtime.tick()
            await runtime.execute_next()  # traced, attempt 2 succeeds
            records = (await runtime.observations.scan(limit=1000)).records
            assert await drain_exporter(runtime.observation_exporter("otel", sink)) == [Tick.EXPORTED, Tick.IDLE]

    logs = receiver.logs
    assert [log.attributes["runlane.observation_id"] for log in logs] == [record.id for record in records]
    traced_logs = [log for log in logs if log.attributes["runlane.run_id"] == traced.id]
    assert [log.body for log in traced_logs] == [
        "run.created",
        "run.delivery_requested",
        "run.lease_claimed",
        "run.started",
        "step.completed",
        "run.retry_scheduled",
        "run.delivery_requested",
        "run.lease_claimed",
        "run.started",
        "run.succeeded",
    ]
    assert [log.event_name for log in traced_logs[3:5]] == ["runlane.run.started", "runlane.step.completed"]
    # The carrier came with run.created only; every later record of the run stays in its trace.
    assert {(log.trace_id, log.span_id) for log in traced_logs} == {(TRACE_ID, PARENT_SPAN_ID)}
    assert {(log.trace_id, log.span_id) for log in logs if log.attributes["runlane.run_id"] == plain.id} == {("", "")}

    retry = traced_logs[5]
    assert (retry.severity_number, retry.severity_text) == (13, "WARN")
    assert retry.attributes["runlane.failure_code"] == "task_failed" and retry.attributes["runlane.attempt"] == 1
    assert {log.severity_text for log in logs if log is not retry} == {"INFO"}
    step = traced_logs[4]
    assert step.attributes["runlane.step_key"] == "fetch" and step.attributes["runlane.source_kind"] == "run_step"
    created = traced_logs[0]
    assert created.attributes["runlane.task_id"] == "reports.build" and created.attributes["runlane.queue"] == "default"
    assert created.attributes["runlane.event_sequence"] == 1 and created.attributes["runlane.status"] == "queued"
    assert created.time == int(T0.timestamp() * 1e9)
    assert created.observed_time == int(records[0].recorded_at.timestamp() * 1e9)
    assert created.resource["service.name"] == "billing-workers"
    assert created.resource["service.namespace"] == "jobs" and created.scope == "runlane"
    # Observations are sanitized: no payload, output or failure detail reaches the endpoint.
    sent = repr([(log.body, log.attributes) for log in logs])
    assert SECRET not in sent and "warehouse" not in sent and "rows" not in sent


async def test_a_refused_log_batch_keeps_the_checkpoint_and_is_sent_again_with_the_same_record_ids() -> None:
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(send, {})
            await runtime.execute_next()
            exporter = runtime.observation_exporter("otel", otlp_sink(endpoint=receiver.logs_endpoint, timeout=2))
            receiver.fail_next(1, status=500)  # a status the OTLP exporter does not retry by itself
            tick = await exporter.export_once()
            assert tick.status is Tick.FAILED
            assert isinstance(tick.error, RunlaneError) and tick.error.code is ErrorCode.OBSERVATION_EXPORT_FAILED
            assert tick.error.retryable and "did not accept 5 log records (HTTP 500" in tick.error.message
            assert receiver.logs == [] and await runtime.observations.checkpoint("otel") is None

            assert await drain_exporter(exporter) == [Tick.EXPORTED, Tick.IDLE]
            first = [log.attributes["runlane.observation_id"] for log in receiver.logs]
            again = otlp_sink(endpoint=receiver.logs_endpoint)
            await again.export((await runtime.observations.scan()).records)
    assert len(first) == 5 and [log.attributes["runlane.observation_id"] for log in receiver.logs] == first * 2


async def test_every_record_of_a_run_is_in_its_trace_even_for_an_exporter_that_did_not_see_it_created() -> None:
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(build, {}, trace_carrier={"traceparent": TRACEPARENT})
            first = runtime.observation_exporter("otel", otlp_sink(endpoint=receiver.logs_endpoint))
            await drain_exporter(first)  # run.created and run.delivery_requested
            await runtime.execute_next()
            # The next `runlane export --once`: a new process, a new sink, nothing remembered.
            second = runtime.observation_exporter("otel", otlp_sink(endpoint=receiver.logs_endpoint))
            await drain_exporter(second)
            traces = otlp_trace_sink(endpoint=receiver.traces_endpoint)
            records = (await runtime.observations.scan()).records
            await traces.export([r for r in records if r.observation.event_sequence not in (1, 2)])
    assert len(receiver.logs) > 4
    assert {(log.trace_id, log.span_id) for log in receiver.logs} == {(TRACE_ID, PARENT_SPAN_ID)}
    (span,) = receiver.spans  # an attempt whose run.created this sink never saw is still under the caller's span
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT_SPAN_ID)


async def test_an_exporter_configured_by_hand_sends_the_same_log_records() -> None:
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        exporter = OTLPLogExporter(endpoint=receiver.logs_endpoint, headers={"x-api-key": "k"}, timeout=5)
        sink = opentelemetry_sink(exporter=exporter, resource_attributes={"deployment.environment": "test"})
        async with runtime:
            run = (await runtime.trigger(send, {})).run
            await runtime.execute_next()
            assert await drain_exporter(runtime.observation_exporter("otel", sink)) == [Tick.EXPORTED, Tick.IDLE]
        sink.close()
    assert [log.body for log in receiver.logs] == [
        "run.created",
        "run.delivery_requested",
        "run.lease_claimed",
        "run.started",
        "run.succeeded",
    ]
    assert {log.attributes["runlane.run_id"] for log in receiver.logs} == {run.id}
    assert receiver.logs[0].resource["deployment.environment"] == "test"



async def test_without_a_service_name_the_service_is_named_as_otel_service_name_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # service_name defaulted to "runlane" and always won, so the OTEL_SERVICE_NAME of a deployment was ignored.
    from runlane_otlp.plugin import OtlpExporterOptions, create_otlp_exporter

    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        unnamed = otlp_sink(endpoint=receiver.logs_endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "billing-workers")
        from_environment = otlp_sink(endpoint=receiver.logs_endpoint)
        options = OtlpExporterOptions(endpoint=receiver.logs_endpoint)  # runlane.toml without service_name
        configured = create_otlp_exporter(options, None)  # type: ignore[arg-type]
        named = otlp_sink(endpoint=receiver.logs_endpoint, service_name="explicit")
        async with runtime:
            await runtime.trigger(send, {})
            sinks = {"unnamed": unnamed, "env": from_environment, "toml": configured, "named": named}
            for consumer, sink in sinks.items():
                assert await drain_exporter(runtime.observation_exporter(consumer, sink)) == [Tick.EXPORTED, Tick.IDLE]
    names = [record.resource["service.name"] for record in receiver.logs if record.body == "run.created"]
    assert names == ["runlane", "billing-workers", "billing-workers", "explicit"]

async def test_without_an_endpoint_the_exporters_read_it_from_the_otel_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The endpoint defaulted to localhost, so a deployment's OTEL_EXPORTER_OTLP_ENDPOINT was ignored and every
    # batch went to a Collector that was not there, retried for ever.
    from runlane_otlp.plugin import OtlpExporterOptions, OtlpTracesExporterOptions, create_otlp_exporter

    for signal in ("", "LOGS_", "TRACES_"):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{signal}PROTOCOL", raising=False)
    for name in ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        base = receiver.logs_endpoint.removesuffix("/v1/logs")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", base + "/")
        sinks = {
            "logs": otlp_sink(),
            "traces": otlp_trace_sink(),
            "toml_logs": create_otlp_exporter(OtlpExporterOptions(), None),  # type: ignore[arg-type]
            "toml_traces": create_otlp_exporter(OtlpTracesExporterOptions(), None),  # type: ignore[arg-type]
        }
        assert [sink.endpoint for sink in sinks.values()] == [receiver.logs_endpoint, receiver.traces_endpoint] * 2
        async with runtime:
            await runtime.trigger(send, {})
            await runtime.execute_next()
            for consumer, sink in sinks.items():
                assert await drain_exporter(runtime.observation_exporter(consumer, sink)) == [Tick.EXPORTED, Tick.IDLE]
    assert len(receiver.spans) == 2 and len(receiver.logs) == 2 * 5  # each sink got the whole run
    # A signal's own variable wins, as it is; an endpoint that is set wins over both.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "http://logs.example:4318/custom")
    assert otlp_sink().endpoint == "http://logs.example:4318/custom"
    assert otlp_trace_sink().endpoint == base + "/v1/traces"
    assert otlp_sink(endpoint="http://set.example/v1/logs").endpoint == "http://set.example/v1/logs"
    assert OtlpExporterOptions(endpoint="http://set.example/v1/logs").endpoint == "http://set.example/v1/logs"
    # A variable the exporter cannot send to is refused with the options, naming it.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")
    with pytest.raises(RunlaneError) as refused:
        otlp_trace_sink()
    assert refused.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in refused.value.message
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        OtlpTracesExporterOptions()
    # An endpoint of the environment meant for gRPC is refused, not sent HTTP requests it never answers.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(RunlaneError, match="OTEL_EXPORTER_OTLP_PROTOCOL is 'grpc'"):
        otlp_trace_sink()
    assert otlp_trace_sink(endpoint="http://collector:4318/v1/traces").endpoint.endswith(":4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # the signal's own wins
    assert otlp_trace_sink().endpoint == "http://collector:4317/v1/traces"
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT")
    assert (otlp_sink().endpoint, otlp_trace_sink().endpoint) == (DEFAULT_LOGS_ENDPOINT, DEFAULT_TRACES_ENDPOINT)



def test_bad_sink_options_are_refused() -> None:
    for make in (otlp_sink, otlp_trace_sink):
        with pytest.raises(RunlaneError) as raised:
            make(endpoint="localhost:4318")
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID and "http(s) URL" in raised.value.message
        bad_options = (
            {"timeout": 0},
            {"timeout": "soon"},
            {"timeout": True},
            {"service_name": ""},
            {"resource_attributes": {"service.namespace": 3}},
        )
        for bad in bad_options:
            with pytest.raises(RunlaneError) as raised:
                make(**bad)
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert raised.value.meta["field"] == next(iter(bad))
        for timeout in ("1500ms", timedelta(seconds=2), 2.5):  # a duration, or seconds
            make(timeout=timeout).close()
    with pytest.raises(RunlaneError) as raised:
        opentelemetry_sink(exporter="http://localhost:4318/v1/logs")
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID and "log record exporter" in raised.value.message


PING_TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("ping")
def ping(payload: dict) -> None:
    return None
"""


def test_runlane_export_sends_log_records_and_spans_to_the_configured_endpoints(tmp_path: Path) -> None:
    from cli_support import background, cli, make_project, wait_for, write

    tasks = PING_TASKS
    root = make_project(tmp_path / "proj", tasks, lane="sqlite")
    with OtlpTestReceiver() as receiver:
        config = (root / "runlane.toml").read_text().replace(
            '# [[exporters]]\n# use = "console"\n# consumer = "local_console"',
            f'[[exporters]]\nuse = "otlp"\nconsumer = "otel_logs"\nendpoint = "{receiver.logs_endpoint}"\n'
            'resource_attributes = { "service.namespace" = "jobs" }\ntimeout = "5s"\n\n'
            f'[[exporters]]\nuse = "otlp-traces"\nconsumer = "otel_traces"\nendpoint = "{receiver.traces_endpoint}"\n'
            'service_name = "cli-test"',
        )
        write(root / "runlane.toml", config)
        assert cli(root, "trigger", "ping", "{}").returncode == 0
        assert cli(root, "work", "--drain").returncode == 0
        with background(root, "export", log=tmp_path / "export.log") as exporter:
            wait_for(lambda: receiver.spans and len(receiver.logs) == 5, what="the exported spans and log records")
            assert exporter.stop() == 0
        (span,) = receiver.spans
        assert span.name == "ping" and span.resource["service.name"] == "cli-test"
        assert span.attributes["runlane.outcome"] == "succeeded"
        assert [log.body for log in receiver.logs][-1] == "run.succeeded"
        assert receiver.logs[0].resource["service.namespace"] == "jobs"
        bad = config.replace('consumer = "otel_logs"', 'consumer = "otel_logs"\nendpiont = "x"')
        write(root / "runlane.toml", bad)
        refused = cli(root, "export", "--once")
        assert refused.returncode == 1 and "endpiont" in refused.stderr and "Traceback" not in refused.stderr
        # Every command checks the options, before anything runs.
        no_scheme = config.replace(f'endpoint = "{receiver.logs_endpoint}"', 'endpoint = "localhost:4318"')
        write(root / "runlane.toml", no_scheme)
        refused = cli(root, "runs", "list")
        assert refused.returncode == 1 and "endpoint must be an http(s) URL" in refused.stderr
    write(root / "runlane.toml", config)
    plugins = json.loads(cli(root, "--json", "plugins", "list").stdout)
    assert any(plugin.get("distribution") == "runlane-otlp" for plugin in plugins["plugins"])


def test_export_once_stops_at_a_second_signal_while_the_endpoint_does_not_answer(tmp_path: Path) -> None:
    # `runlane export --once` took no stop signal while a batch waited for an endpoint: Ctrl-C ended it only
    # once the export's timeout had passed, without a word, and a second one made it report the batch failed.
    import signal
    import socket
    import subprocess

    from cli_support import RUNLANE, cli, cli_env, make_project, wait_for, write

    root = make_project(tmp_path / "proj", PING_TASKS, lane="sqlite")
    log = tmp_path / "export.log"
    with socket.socket() as silent, log.open("w") as out:  # an endpoint that takes the request, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(30)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}/v1/logs"
        config = (root / "runlane.toml").read_text().replace(
            '# [[exporters]]\n# use = "console"\n# consumer = "local_console"',
            f'[[exporters]]\nuse = "otlp"\nconsumer = "otel_logs"\nendpoint = "{endpoint}"\ntimeout = "60s"\n',
        )
        write(root / "runlane.toml", config)
        assert cli(root, "trigger", "ping", "{}").returncode == 0
        assert RUNLANE is not None
        process = subprocess.Popen(
            [RUNLANE, "export", "--once"], cwd=root, stdout=out, stderr=subprocess.STDOUT, text=True, env=cli_env()
        )
        try:
            connection, _ = silent.accept()  # the batch is on its way
            with connection:
                process.send_signal(signal.SIGINT)
                wait_for(lambda: "stopping after the current batch" in log.read_text(), timeout=10, what="stopping")
                process.send_signal(signal.SIGTERM)  # the second stop signal: at once
                status = process.wait(timeout=10)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    text = log.read_text()
    assert status == 128 + signal.SIGTERM, text
    assert "received SIGTERM again; exiting now" in text and "Traceback" not in text


async def test_an_attempt_made_due_without_a_delivery_request_has_no_queue_wait() -> None:
    runtime, clock = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(build, {})
            await runtime.execute_next()  # attempt 1 fails; the retry is due later
            clock.advance(timedelta(minutes=5))
            await runtime.execute_next()  # a polling worker claims the due retry: no run.delivery_requested
            sink = otlp_trace_sink(endpoint=receiver.traces_endpoint)
            await drain_exporter(runtime.observation_exporter("tracing", sink))
    first, second = sorted(receiver.spans, key=lambda span: span.attributes["runlane.attempt"])
    assert first.attributes["runlane.queue_wait_ms"] == 0
    assert "runlane.queue_wait_ms" not in second.attributes  # not the time since attempt 1 was requested


@task("reports.crashing")
async def crashing(payload: dict[str, Any], ctx: TaskContext) -> None:
    crashed.append(ctx.attempt)
    if ctx.attempt == 1:
        await asyncio.sleep(3600)  # stands in for an attempt that takes its worker process down


crashed: list[int] = []


async def _crash_next_attempt(runtime: Any, clock: ControlledClock) -> None:
    """Run the next attempt until its handler starts, then drop it as a killed worker would (no outcome,
    no heartbeat), and let its lease expire."""
    started = len(crashed)
    attempt = asyncio.ensure_future(runtime.execute_next(lease_duration="30s", heartbeat_interval="20s"))
    for _ in range(1000):
        if len(crashed) > started or attempt.done():
            break
        await asyncio.sleep(0.005)
    assert len(crashed) == started + 1, "the attempt never started"
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    clock.advance(timedelta(seconds=31))


async def test_an_attempt_that_ended_with_no_outcome_is_an_abandoned_span() -> None:
    clock = ControlledClock(T0)
    runtime = create_runlane(lane=local_lane(), queues=[default], tasks=[crashing], clock=clock)
    with OtlpTestReceiver() as receiver:
        sink = otlp_trace_sink(endpoint=receiver.traces_endpoint)
        async with runtime:
            retried = (await runtime.trigger(crashing, {}, trace_carrier={"traceparent": TRACEPARENT})).run
            await _crash_next_attempt(runtime, clock)
            assert (await runtime.tick()).delivery_requested == 1  # the lease expired: the run is due again
            assert (await runtime.execute_next()).status.value == "succeeded"  # attempt 2
            cancelled = (await runtime.trigger(crashing, {})).run
            crashed.clear()
            await _crash_next_attempt(runtime, clock)
            await runtime.tick()
            await runtime.runs.cancel(cancelled.id)  # queued again after the crash: no attempt is cancelled
            assert await drain_exporter(runtime.observation_exporter("tracing", sink)) == [Tick.EXPORTED, Tick.IDLE]
            attempts = {run.id: await runtime.runs.attempts(run.id) for run in (retried, cancelled)}
    spans = {(s.attributes["runlane.run_id"], s.attributes["runlane.attempt"]): s for s in receiver.spans}
    # Every attempt runs.attempts() counts is one span, the crashed ones included.
    assert sorted(spans) == sorted((run_id, a.attempt) for run_id, items in attempts.items() for a in items)
    for run in (retried, cancelled):
        lost = spans[(run.id, 1)]
        assert lost.attributes["runlane.outcome"] == "abandoned"
        assert lost.attributes["runlane.end_unknown"] is True and "runlane.start_unknown" not in lost.attributes
        assert lost.status_code == 2  # STATUS_CODE_ERROR
        assert lost.start_time == int(attempts[run.id][0].started_at.timestamp() * 1e9)
        assert lost.end_time > lost.start_time  # ended when the expired lease was found
        assert lost.attributes["runlane.queue_wait_ms"] == 0  # started as soon as it was triggered
    assert spans[(retried.id, 1)].parent_span_id == PARENT_SPAN_ID
    assert spans[(retried.id, 2)].attributes["runlane.outcome"] == "succeeded"
    assert len({s.span_id for s in receiver.spans}) == len(receiver.spans)


async def test_a_refused_export_is_reported_by_runlane_alone(caplog: pytest.LogCaptureFixture) -> None:
    runtime, _ = runtime_and_clock()
    caplog.set_level(logging.WARNING)
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(send, {})
            receiver.fail_next(2, status=503)  # retried by OpenTelemetry's exporter within the timeout
            sink = otlp_sink(endpoint=receiver.logs_endpoint, timeout=5)
            tick = await runtime.observation_exporter("otel", sink).export_once()
    assert tick.status is Tick.EXPORTED and receiver.requests == 3
    assert [r.getMessage() for r in caplog.records if r.name.startswith("opentelemetry")] == []


async def test_an_endpoint_s_credentials_and_query_values_are_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    secrets = ("apiuser", "S3CRET", "QS3CRET", "HS3CRET")
    caplog.set_level(logging.WARNING)  # (urllib3's DEBUG lines show each request's path and query)

    def shown(*texts: object) -> list[str]:
        return [secret for secret in secrets if any(secret in str(text) for text in texts)]

    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(send, {})
            host = receiver.logs_endpoint.removeprefix("http://").removesuffix("/v1/logs")
            unreachable = otlp_sink(
                endpoint="http://apiuser:S3CRET@127.0.0.1:1/v1/logs?api_key=QS3CRET",
                headers={"x-api-key": "HS3CRET"},
                timeout=1,
            )
            assert unreachable.endpoint == "http://***@127.0.0.1:1/v1/logs?api_key=***"
            tick = await runtime.observation_exporter("unreachable", unreachable).export_once()
            assert tick.status is Tick.FAILED and isinstance(tick.error, RunlaneError) and tick.error.retryable
            assert tick.error.meta["endpoint"] == unreachable.endpoint
            assert tick.error.message.startswith("http://***@127.0.0.1:1/v1/logs?api_key=*** did not accept")
            assert not shown(tick.error.message, tick.error.meta, repr(tick.error), repr(unreachable))
            # The receiver answers a path with a query string with HTTP 404: refused for good.
            refusing = otlp_trace_sink(endpoint=f"http://apiuser:S3CRET@{host}/v1/traces?api_key=QS3CRET&x=1")
            redacted = f"http://***@{host}/v1/traces?api_key=***&x=***"
            assert repr(refusing) == f"OtlpObservationSink(spans, endpoint={redacted!r}, exported=0)"
            await runtime.execute_next()
            with pytest.raises(RunlaneError) as refused:
                await refusing.export((await runtime.observations.scan()).records)
            assert "HTTP 404" in refused.value.message and not refused.value.retryable
            assert not shown(refused.value.message, refused.value.meta)
            refusing.close()
    exporter = OTLPLogExporter(endpoint="https://apiuser:S3CRET@collector/v1/logs?k=QS3CRET")
    by_hand = opentelemetry_sink(exporter=exporter)
    assert by_hand.endpoint == "https://***@collector/v1/logs?k=***" and not shown(repr(by_hand))
    for endpoint in ("apiuser:S3CRET@collector:4318/v1/logs", "ftp://apiuser:S3CRET@collector/v1/logs?k=QS3CRET"):
        with pytest.raises(RunlaneError) as invalid:
            otlp_sink(endpoint=endpoint)
        assert invalid.value.code is ErrorCode.CONFIGURATION_INVALID and "***@collector" in invalid.value.message
        assert not shown(invalid.value.message)
    assert not shown(*(record.getMessage() for record in caplog.records))
    unreachable.close()


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("http://127.0.0.1:43180000/v1/logs", "has a port that is not a number from 0 to 65535"),
        ("http://collector:http/v1/logs", "has a port that is not a number from 0 to 65535"),
        ("http://", "names no host"),
        ("http:///v1/logs", "names no host"),
        ("http:// bad host/v1/logs", "has whitespace in it"),
        ("https://apiuser:S3CRET@collector:99999/v1/logs", "has a port that is not a number"),
    ],
)
def test_an_endpoint_no_request_can_go_to_is_refused_when_the_sink_is_built(endpoint: str, says: str) -> None:
    """Not at the first export: every command that reads runlane.toml checks the exporter options."""
    for build in (otlp_sink, otlp_trace_sink):
        with pytest.raises(RunlaneError) as invalid:
            build(endpoint=endpoint)
        assert invalid.value.code is ErrorCode.CONFIGURATION_INVALID and invalid.value.meta == {"field": "endpoint"}
        assert says in invalid.value.message and "S3CRET" not in invalid.value.message


def test_an_exporter_refused_for_good_stops_alone_and_the_others_and_dev_go_on(tmp_path: Path) -> None:
    """Telemetry never stops the work it observes: an endpoint answering 404 stops its own exporter (which
    says so), not the other exporters of `runlane export`, nor the worker and maintenance of `runlane dev`."""
    from cli_support import background, cli, make_project, wait_for, write

    root = make_project(tmp_path / "proj", PING_TASKS, lane="sqlite")
    with OtlpTestReceiver() as receiver:
        config = (root / "runlane.toml").read_text().replace(
            '# [[exporters]]\n# use = "console"\n# consumer = "local_console"',
            f'[[exporters]]\nuse = "otlp"\nconsumer = "otel_logs"\nendpoint = "{receiver.logs_endpoint}/nowhere"\n\n'
            f'[[exporters]]\nuse = "otlp-traces"\nconsumer = "otel_traces"\nendpoint = "{receiver.traces_endpoint}"\n',
        )
        write(root / "runlane.toml", config)
        assert cli(root, "trigger", "ping", "{}").returncode == 0
        with background(root, "dev", "--tick-interval", "100ms", log=tmp_path / "dev.log") as dev:
            failed = dev.wait_for("exporter_failed")
            assert failed["exporter"] == "otlp" and failed["error_code"] == "observation_export_failed"
            wait_for(lambda: receiver.spans, what="the spans of the run dev executed")
            assert cli(root, "trigger", "ping", "{}").returncode == 0  # dev still serves and runs
            wait_for(lambda: len(receiver.spans) == 2, what="the second run's span")
            assert dev.process.poll() is None
            assert dev.stop() == 1  # stopped on request; the exporter's failure is its status
        assert cli(root, "trigger", "ping", "{}").returncode == 0
        assert cli(root, "work", "--drain").returncode == 0
        with background(root, "export", log=tmp_path / "export.log") as exporter:
            exporter.wait_for("exporter_failed")
            wait_for(lambda: len(receiver.spans) == 3, what="the third run's span")
            assert exporter.process.poll() is None  # the traces exporter goes on
            assert exporter.stop() == 1
    assert receiver.logs == []


@pytest.mark.parametrize("status", [301, 308])
async def test_a_redirect_is_not_taken_for_an_accepted_batch(status: int) -> None:
    """OpenTelemetry's exporter follows no redirect yet counts a 3xx as accepted: the exporter stops naming
    the URL to use, with the checkpoint where it was, instead of checkpointing records nobody received."""
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        sink = otlp_sink(endpoint=receiver.logs_endpoint, timeout=2)
        async with runtime:
            await runtime.trigger(send, {})
            receiver.fail_next(1, status=status, location="https://user:pw@collector.example/v1/logs?key=s3cret")
            with pytest.raises(RunlaneError) as raised:
                await runtime.observation_exporter("logs", sink).run(retry_delay="10ms", idle_delay="10ms")
            error = raised.value
            assert error.code is ErrorCode.OBSERVATION_EXPORT_FAILED and not error.retryable
            assert error.meta["http_status"] == status
            assert error.meta["location"] == "https://***@collector.example/v1/logs?key=***"
            assert f"with HTTP {status}" in error.message and "Set the endpoint to the URL" in error.message
            assert "s3cret" not in error.message and "pw" not in error.message
            assert await runtime.observations.checkpoint("logs") is None
            assert receiver.logs == [] and receiver.requests == 1


@pytest.mark.parametrize("compression", ["gzip", "deflate"])
async def test_compressed_exports_reach_the_test_receiver(monkeypatch: pytest.MonkeyPatch, compression: str) -> None:
    """OTEL_EXPORTER_OTLP_COMPRESSION, which OpenTelemetry's exporter reads, compresses the requests: the
    test receiver decodes them as a Collector does."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression)
    runtime, _ = runtime_and_clock()
    with OtlpTestReceiver() as receiver:
        async with runtime:
            await runtime.trigger(send, {})
            sink = otlp_sink(endpoint=receiver.logs_endpoint, timeout=2)
            assert await drain_exporter(runtime.observation_exporter("logs", sink)) == [Tick.EXPORTED, Tick.IDLE]
    assert [log.body for log in receiver.logs] == ["run.created", "run.delivery_requested"]


def test_the_test_receiver_answers_a_body_that_is_not_an_export_request_with_400() -> None:
    import urllib.error
    import urllib.request

    with OtlpTestReceiver() as receiver:
        request = urllib.request.Request(receiver.logs_endpoint, data=b"\xff\xff not protobuf", method="POST")
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request, timeout=5)
        assert raised.value.code == 400
    assert receiver.logs == []
