"""Bad input to runlane-sqs: bindings, transport options, wakeup bodies, runtime drift checks and the
``postgres-sqs`` options of ``runlane.toml``. Every mistake is a ``RunlaneError`` with a stable code and a
message that says what to change, raised before anything talks to SQS."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
from cli_support import cli
import postgres_support
from postgres_support import INVALID_TIMEOUTS
from pydantic import ValidationError
from runlane_local import local_storage_driver
from runlane_sqs import (
    SqsFifoDeduplication,
    SqsFifoMessageGroup,
    SqsFifoOptions,
    SqsQueueSourceType,
    parse_sqs_wakeup_body,
    postgres_sqs_lane,
    sqs_queue,
    sqs_transport,
)
from runlane_sqs.testing import TEST_CREDENTIALS, SqsTestServer

from runlane import ErrorCode, LaneDelivery, LaneDeliveryMode, RunlaneError, create_lane, create_runlane, queue
from runlane.plugins.manager import get_registries
from runlane.plugins.registries import validate_options

URL = "https://sqs.us-east-1.amazonaws.com/123456789012/runlane-default"
FIFO_URL = "https://sqs.us-east-1.amazonaws.com/123456789012/runlane-ordered.fifo"
default = queue("default", default=True)
bounded = queue("bounded", concurrency_limit=2)


def client() -> Any:
    # A real boto3 client; nothing here makes a call, so nothing needs to listen.
    return SqsTestServer().client()


def error_of(call: Any) -> RunlaneError:
    with pytest.raises(RunlaneError) as raised:
        call()
    return raised.value


# ---------------------------------------------------------------------------------------------
# sqs_queue


def test_a_binding_by_url_by_name_and_with_fifo_defaults() -> None:
    by_url = sqs_queue(default, queue_url=URL)
    assert (by_url.queue, by_url.source_type, by_url.source, by_url.fifo) == (
        default,
        SqsQueueSourceType.QUEUE_URL,
        URL,
        None,
    )
    by_name = sqs_queue("emails", queue_name="runlane-emails", queue_owner_aws_account_id="123456789012")
    assert (by_name.queue_name, by_name.source_type, by_name.queue_owner_aws_account_id) == (
        "emails",
        SqsQueueSourceType.QUEUE_NAME,
        "123456789012",
    )
    fifo = sqs_queue(default, queue_url=FIFO_URL, fifo=True)
    assert fifo.fifo == SqsFifoOptions(SqsFifoMessageGroup.RUN, SqsFifoDeduplication.OUTBOX)
    grouped = sqs_queue(default, queue_name="ordered.fifo", fifo={"message_group": "queue"})
    assert grouped.fifo is not None and grouped.fifo.message_group is SqsFifoMessageGroup.QUEUE


@pytest.mark.parametrize(
    ("kwargs", "field", "says"),
    [
        ({}, "queue_url", "exactly one of queue_url or queue_name"),
        ({"queue_url": URL, "queue_name": "x"}, "queue_url", "exactly one of queue_url or queue_name"),
        ({"queue_url": "sqs://queue"}, "queue_url", "https://sqs.us-east-1.amazonaws.com/123456789012/my-queue"),
        ({"queue_url": "https://sqs.us-east-1.amazonaws.com"}, "queue_url", "is not an SQS queue URL"),
        ({"queue_name": "has space"}, "queue_name", "1-80 letters, digits"),
        ({"queue_name": "x" * 81}, "queue_name", "1-80 letters, digits"),
        ({"queue_url": URL, "queue_owner_aws_account_id": "123456789012"}, "queue_owner_aws_account_id", "only"),
        ({"queue_name": "q", "queue_owner_aws_account_id": "12345"}, "queue_owner_aws_account_id", "12-digit"),
        ({"queue_url": FIFO_URL}, "fifo", "pass fifo=True"),
        ({"queue_url": URL, "fifo": True}, "fifo", "is a standard queue"),
        ({"queue_url": FIFO_URL, "fifo": {"message_group": "tenant"}}, "fifo.message_group", "'run', 'queue'"),
        ({"queue_url": FIFO_URL, "fifo": {"dedupe": "outbox"}}, "fifo", "Unknown fifo option 'dedupe'"),
        ({"queue_url": FIFO_URL, "fifo": "yes"}, "fifo", "fifo must be True"),
    ],
)
def test_a_bad_binding_is_refused_with_what_to_change(kwargs: dict[str, Any], field: str, says: str) -> None:
    error = error_of(lambda: sqs_queue(default, **kwargs))
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert error.meta["field"] == field
    assert says in error.message


def test_a_binding_needs_a_queue_definition_or_a_valid_queue_name() -> None:
    assert error_of(lambda: sqs_queue(42, queue_url=URL)).meta["field"] == "queue"  # type: ignore[arg-type]
    assert "':' is reserved" in error_of(lambda: sqs_queue("a:b", queue_url=URL)).message


# ---------------------------------------------------------------------------------------------
# sqs_transport


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"queues": []}, "non-empty list of sqs_queue(...) bindings"),
        ({"queues": sqs_queue("default", queue_url=URL)}, "non-empty list of sqs_queue(...) bindings"),
        ({"queues": [{"queue_url": URL}]}, "must come from sqs_queue(...)"),
        (
            {"queues": [sqs_queue("default", queue_url=URL), sqs_queue(default, queue_name="other")]},
            "Queue 'default' is bound twice",
        ),
        ({"queues": [sqs_queue("default", queue_url=URL)], "batch_size": 11}, "from 1 to 10"),
        ({"queues": [sqs_queue("default", queue_url=URL)], "batch_size": 0}, "from 1 to 10"),
        ({"queues": [sqs_queue("default", queue_url=URL)], "name": ""}, "non-empty string"),
    ],
)
def test_bad_transport_options_are_refused(kwargs: dict[str, Any], says: str) -> None:
    error = error_of(lambda: sqs_transport(client=client(), **kwargs))
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert says in error.message


def test_a_transport_needs_an_sqs_client() -> None:
    error = error_of(lambda: sqs_transport(client=object(), queues=[sqs_queue("default", queue_url=URL)]))
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert "boto3.client('sqs')" in error.message and "send_message_batch" in error.message


def test_capabilities_claim_fifo_order_only_when_every_queue_is_fifo() -> None:
    mixed = sqs_transport(
        client=client(),
        queues=[sqs_queue("default", queue_url=URL), sqs_queue("ordered", queue_url=FIFO_URL, fifo=True)],
    )
    assert mixed.capabilities.durable_delivery and not mixed.capabilities.native_delay
    assert not mixed.capabilities.message_grouping and not mixed.capabilities.ordered_delivery
    fifo = sqs_transport(client=client(), queues=[sqs_queue("ordered", queue_url=FIFO_URL, fifo=True)])
    assert fifo.capabilities.message_grouping and fifo.capabilities.ordered_delivery


# ---------------------------------------------------------------------------------------------
# create_runlane checks the bindings against its registry


def transport_lane(*bindings: Any) -> Any:
    transport = sqs_transport(client=client(), queues=list(bindings))
    return create_lane(
        storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
    )


def test_every_registered_queue_needs_a_binding() -> None:
    lane = transport_lane(sqs_queue(default, queue_url=URL))
    error = error_of(lambda: create_runlane(lane=lane, queues=[default, bounded]))
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert "no binding for queue 'bounded'" in error.message
    assert error.meta["queues"] == ["bounded"]


def test_a_binding_for_an_unregistered_queue_is_refused() -> None:
    lane = transport_lane(sqs_queue(default, queue_url=URL), sqs_queue("retired", queue_name="old"))
    error = error_of(lambda: create_runlane(lane=lane, queues=[default]))
    assert "binds queue 'retired', which is not registered" in error.message


def test_a_binding_whose_queue_policy_drifted_is_refused() -> None:
    drifted = queue("bounded", concurrency_limit=5)
    lane = transport_lane(sqs_queue(default, queue_url=URL), sqs_queue(drifted, queue_name="bounded"))
    error = error_of(lambda: create_runlane(lane=lane, queues=[default, bounded]))
    assert "differs from the registered definition (drift)" in error.message


def test_bindings_by_definition_or_by_name_both_satisfy_the_registry() -> None:
    lane = transport_lane(sqs_queue(default, queue_url=URL), sqs_queue("bounded", queue_name="bounded"))
    runtime = create_runlane(lane=lane, queues=[default, bounded])
    assert runtime.lane.delivery.transport.queues == (default, "bounded")


# ---------------------------------------------------------------------------------------------
# Wakeup bodies


GOOD = {
    "type": "runlane.wakeup",
    "version": 1,
    "message": {
        "environment": {"name": "p"},
        "run_id": "run_1",
        "queue": "default",
        "requested_at": "2026-11-30T08:00:00Z",
    },
}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("not json", "the body is not JSON"),
        ("[]", "not a JSON object"),
        (json.dumps({**GOOD, "type": "other"}), "its type is 'other'"),
        (json.dumps({**GOOD, "version": 2}), "its version is 2; this Runlane reads version 1"),
        (json.dumps({**GOOD, "version": True}), "its version is True"),
        (json.dumps({**GOOD, "payload": {}}), "unknown key 'payload'"),
        (
            json.dumps({**GOOD, "message": {**GOOD["message"], "run_id": ""}}),
            "message.run_id: Invalid run id: it must not be empty. Runlane queues",
        ),
        (json.dumps({**GOOD, "message": {**GOOD["message"], "requested_at": "yesterday"}}), "message.requested_at"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "message"}), "message: Input should be"),
        (b"\xff\xfe", "not UTF-8"),
        (None, "the body is NoneType"),
        ("x" * 300_000, "more than any wakeup"),
    ],
)
def test_a_body_that_is_not_a_wakeup_is_refused_with_the_reason(body: Any, says: str) -> None:
    error = error_of(lambda: parse_sqs_wakeup_body(body))
    assert error.code is ErrorCode.VALIDATION_FAILED
    assert says in error.message
    assert "redrive" in error.message


def test_a_good_body_parses_to_an_aware_delivery_message() -> None:
    message = parse_sqs_wakeup_body(json.dumps(GOOD))
    assert message.run_id == "run_1" and message.requested_at.tzinfo is not None


# ---------------------------------------------------------------------------------------------
# postgres_sqs_lane and runlane.toml


def test_postgres_sqs_lane_refuses_unknown_and_missing_nested_options() -> None:
    sqs = {"client": client(), "queues": [sqs_queue("default", queue_url=URL)]}
    unknown = error_of(lambda: postgres_sqs_lane(postgres={"connection_string": "postgres://x/y", "nope": 1}, sqs=sqs))
    assert "Unknown postgres option 'nope'" in unknown.message and unknown.meta["field"] == "postgres.nope"
    missing = error_of(lambda: postgres_sqs_lane(postgres={"connection_string": "postgres://x/y"}, sqs={"client": 1}))
    assert missing.meta["field"] == "sqs.queues"
    not_a_table = error_of(lambda: postgres_sqs_lane(postgres="postgres://x/y", sqs=sqs))  # type: ignore[arg-type]
    assert "postgres={...}" in not_a_table.message


def test_postgres_sqs_lane_composes_a_durable_transport_lane() -> None:
    lane = postgres_sqs_lane(
        postgres={"connection_string": "postgresql://runlane@127.0.0.1:9/runlane", "schema": "jobs"},
        sqs={"client": client(), "queues": [sqs_queue(default, queue_url=URL)]},
    )
    assert lane.name == "postgres-sqs"
    assert lane.delivery.mode is LaneDeliveryMode.TRANSPORT
    assert lane.capabilities.production_durable and lane.capabilities.operator_reads


def lane_options(**sqs: Any) -> dict[str, Any]:
    return {
        "postgres": {"connection_string": "postgresql://runlane@127.0.0.1:9/runlane"},
        "sqs": {"region": "us-east-1", "queues": {"default": {"queue_url": URL}}, **sqs},
    }


def test_the_toml_options_build_bindings_and_a_client() -> None:
    provider = get_registries().lanes.get("postgres-sqs")
    options = validate_options(
        provider,
        lane_options(
            endpoint_url="",  # "${VAR:-}" left unset
            queues={
                "default": {"queue_url": URL},
                "ordered": {"queue_name": "ordered.fifo", "fifo": {"message_group": "queue"}},
            },
        ),
    )
    lane = provider.create(options, None)
    transport = lane.delivery.transport
    assert [binding.queue_name for binding in transport.bindings] == ["default", "ordered"]
    assert transport.bindings[1].fifo == SqsFifoOptions(SqsFifoMessageGroup.QUEUE)
    assert transport.client.meta.region_name == "us-east-1"
    assert transport.client.meta.endpoint_url == "https://sqs.us-east-1.amazonaws.com"
    assert lane.storage.name == "postgres-storage"
    named = lane_options()
    named["postgres"]["name"] = "orders-db"  # [lane.postgres] name reaches the storage driver
    assert provider.create(validate_options(provider, named), None).storage.name == "orders-db"


def configured_lane(tmp_path: Path, postgres_options: str) -> Any:
    """The postgres-sqs lane of ``runlane.toml`` with ``postgres_options``, built as the CLI builds it."""
    return postgres_support.configured_lane(
        tmp_path,
        '[lane]\nuse = "postgres-sqs"\n\n[lane.postgres]\nconnection_string = "postgresql://db/app"\n'
        f'{postgres_options}\n[lane.sqs]\nregion = "us-east-1"\n\n[lane.sqs.queues.default]\nqueue_url = "{URL}"\n',
    )


def test_toml_postgres_timeouts_reach_the_driver(tmp_path: Path) -> None:
    # The same keys as a postgres-polling lane, and as postgres_sqs_lane(postgres={...}) from Python.
    lane = configured_lane(tmp_path, 'statement_timeout = "5m"\npool_timeout = "1500ms"\nconnect_timeout = 3\n')
    storage = lane.storage
    assert (storage.statement_timeout, storage.pool_timeout, storage.connect_timeout) == (300.0, 1.5, 3.0)
    assert storage.name == "postgres-storage"
    defaults = configured_lane(tmp_path, "").storage
    assert (defaults.statement_timeout, defaults.pool_timeout, defaults.connect_timeout) == (30.0, 30.0, 10.0)


@pytest.mark.parametrize(
    ("option", "value"),
    INVALID_TIMEOUTS,
)
def test_invalid_toml_postgres_timeouts_are_configuration_invalid(tmp_path: Path, option: str, value: str) -> None:
    with pytest.raises(RunlaneError) as info:
        configured_lane(tmp_path, f"{option} = {value}\n")
    key = f"postgres.{option}"
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID
    assert f"key {key!r}" in info.value.message and info.value.meta["keys"] == [key]
    assert "unknown key" not in info.value.message
    # Word for word the problem a postgres-polling lane reports for the same value.
    polling_options = {"connection_string": "postgresql://db/app", **tomllib.loads(f"{option} = {value}")}
    polling = error_of(lambda: validate_options(get_registries().lanes.get("postgres-polling"), polling_options))
    problem = polling.message.split(f"key {option!r}: ")[1].split(". Allowed keys")[0]
    assert f"key {key!r}: {problem}." in info.value.message
    # The CLI says the same, without a traceback.
    result = cli(tmp_path, "runs", "list")
    assert result.returncode == 1 and "error[configuration_invalid]" in result.stderr
    assert key in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (lane_options(queue={}), "unknown key 'sqs.queue'"),
        (lane_options(queues={}), "sqs.queues"),
        (
            lane_options(queues={"default": {"url": URL}}),
            "unknown key 'sqs.queues.default.url' (allowed there: fifo, queue_name, queue_owner_aws_account_id, "
            "queue_url)",
        ),
        (
            lane_options(regoin="us-east-1"),
            "unknown key 'sqs.regoin' (allowed there: batch_size, connect_timeout, endpoint_url, name, profile, "
            "queues, read_timeout, region)",
        ),
        (
            lane_options(queues={"default": {"queue_url": FIFO_URL, "fifo": {"group": "run"}}}),
            "unknown key 'sqs.queues.default.fifo.group' (allowed there: deduplication, message_group)",
        ),
        (lane_options(batch_size=20), "sqs.batch_size"),
    ],
)
def test_bad_toml_options_name_the_key(options: dict[str, Any], says: str) -> None:
    provider = get_registries().lanes.get("postgres-sqs")
    error = error_of(lambda: validate_options(provider, options))
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert says in error.message


def test_a_toml_binding_mistake_is_reported_when_the_lane_is_built() -> None:
    provider = get_registries().lanes.get("postgres-sqs")
    options = validate_options(provider, lane_options(queues={"default": {"queue_url": FIFO_URL}}))
    error = error_of(lambda: provider.create(options, None))
    assert "pass fifo=True" in error.message


def test_lane_sqs_options_bound_the_client_and_a_missing_profile_is_named() -> None:
    from runlane_sqs.plugin import SqsTransportOptions, sqs_client

    queues = {"default": {"queue_url": URL}}
    client = sqs_client(SqsTransportOptions(queues=queues, region="us-east-1", connect_timeout="2s", read_timeout=25))
    assert (client.meta.config.connect_timeout, client.meta.config.read_timeout) == (2.0, 25.0)
    defaults = SqsTransportOptions(queues=queues)
    assert (defaults.connect_timeout, defaults.read_timeout) == (5.0, 30.0)
    with pytest.raises(ValidationError, match="longer than the 20 s long poll"):
        SqsTransportOptions(queues=queues, read_timeout="10s")

    with pytest.raises(RunlaneError) as raised:
        sqs_client(SqsTransportOptions(queues=queues, region="us-east-1", profile="no-such-profile-here"))
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "no-such-profile-here" in raised.value.message and "check endpoint_url and profile" in raised.value.message



def test_a_lane_sqs_client_without_a_region_names_the_variable_boto3_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    # AWS_REGION (what Lambda, ECS and the other AWS SDKs use) is not read by boto3: a message telling to set
    # it sends the operator round in circles.
    from runlane_sqs.plugin import SqsTransportOptions, sqs_client

    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/runlane-test-aws-config")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(RunlaneError) as raised:
        sqs_client(SqsTransportOptions(queues={"default": {"queue_url": URL}}))
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "AWS_DEFAULT_REGION" in raised.value.message
    assert 'region = "${AWS_REGION}"' in raised.value.message


def test_a_call_of_the_lane_sqs_client_is_tried_three_times_in_all(
    monkeypatch: pytest.MonkeyPatch, sqs_refusing: Any
) -> None:
    # The docs and the read_timeout bound promise at most three tries of a call (so a trigger waits at most
    # three read timeouts for a hanging endpoint); botocore's ``max_attempts`` counts retries, not tries.
    from botocore.exceptions import ClientError

    from runlane_sqs.plugin import SqsTransportOptions, sqs_client

    for name, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    endpoint = sqs_refusing(500, "InternalError")
    options = SqsTransportOptions(queues={"default": {"queue_url": URL}}, region="us-east-1", endpoint_url=endpoint)
    with pytest.raises(ClientError):
        sqs_client(options).send_message(QueueUrl=f"{endpoint}/123456789012/runlane-default", MessageBody="{}")
    assert sqs_refusing.calls == ["AmazonSQS.SendMessage"] * 3


@pytest.mark.parametrize(
    ("postgres_options", "says"),
    [
        ('shema = "runlane"\n', "unknown key 'postgres.shema'"),
        ("schema = 5\n", "key 'postgres.schema'"),
        ('url = "postgresql://db/other"\n', "set connection_string or its alias url, not both"),
    ],
)
def test_postgres_migrate_refuses_a_postgres_sqs_lane_its_postgres_table_is_wrong_in(
    tmp_path: Path, postgres_options: str, says: str
) -> None:
    """Checked as every command checks it, before connecting: never a migration of the schema a misspelt
    key left out (public, in place of the one meant)."""
    (tmp_path / "runlane.toml").write_text(
        '[lane]\nuse = "postgres-sqs"\n\n[lane.postgres]\nconnection_string = "postgresql://nobody@127.0.0.1:1/app"\n'
        f'{postgres_options}\n[lane.sqs]\nregion = "us-east-1"\n\n[lane.sqs.queues.default]\nqueue_url = "{URL}"\n'
    )
    result = cli(tmp_path, "postgres", "migrate")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error[configuration_invalid]: runlane.toml: Invalid options in [lane]")
    assert says in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "endpoint, shown",
    [
        ("http://key:Sqs5ecret@local host:4566", "Invalid endpoint: http://***@local host:4566"),
        (
            "http://key:Sqs5ecret@local host:4566/?token=Sqs5ecret",
            "Invalid endpoint: http://***@local host:4566/?token=***",
        ),
    ],
)
def test_an_endpoint_url_botocore_refuses_is_shown_without_its_credentials(
    tmp_path: Path, endpoint: str, shown: str
) -> None:
    (tmp_path / "tasks.py").write_text('from runlane import queue\n\ndefault = queue("default", default=True)\n')
    (tmp_path / "runlane.toml").write_text(
        '[runlane]\ntasks = ["tasks"]\n\n[lane]\nuse = "postgres-sqs"\n\n[lane.postgres]\n'
        'connection_string = "postgresql://nobody@127.0.0.1:1/app"\n\n[lane.sqs]\nregion = "us-east-1"\n'
        f'endpoint_url = "{endpoint}"\n\n[lane.sqs.queues.default]\nqueue_url = "{URL}"\n'
    )
    result = cli(tmp_path, "runs", "list")
    assert result.returncode == 1 and "error[configuration_invalid]: " in result.stderr, result.stderr
    assert f"Cannot create the SQS client: ValueError: {shown}. " in result.stderr, result.stderr
    assert "Sqs5ecret" not in result.stdout + result.stderr and "Traceback" not in result.stderr
