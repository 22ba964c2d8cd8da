"""Durable steps: deterministic tokens, checkpoint once per run, replay, output schemas, fencing."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
from pydantic import BaseModel

from runlane import Environment, ErrorCode, Retry, RunlaneError, RunlaneObservationType, RunStatus, TaskContext, task
from runlane.core.attempt import step_token

from runtime_support import make_runtime


class Submission(BaseModel):
    job_id: str


def test_step_token_is_deterministic_for_environment_run_and_key():
    token = step_token(Environment(name="prod"), "run_1", "submit")
    expected = hashlib.sha256(json.dumps(["prod", "run_1", "submit"], separators=(",", ":")).encode()).hexdigest()
    assert token == f"step_{expected}"
    assert token == step_token(Environment(name="prod"), "run_1", "submit")
    assert len({
        token,
        step_token(Environment(name="dev"), "run_1", "submit"),
        step_token(Environment(name="prod"), "run_2", "submit"),
        step_token(Environment(name="prod"), "run_1", "poll"),
    }) == 4


async def test_a_step_runs_once_per_run_and_replays_its_stored_output():
    calls: list[str] = []
    seen: list[Submission] = []

    @task("pdf.render")
    async def render(payload: dict, ctx: TaskContext):
        async def submit(token: str) -> dict:
            calls.append(token)
            return {"job_id": f"job_{len(calls)}"}

        submission = await ctx.step.run("submit-render-job", submit, output=Submission)
        seen.append(submission)
        if ctx.attempt == 1:
            return ctx.release("30s", meta={"job": submission.job_id})
        return submission.job_id

    runtime, clock = make_runtime(render)
    async with runtime:
        run = (await runtime.trigger(render, {})).run
        assert (await runtime.execute_next()).status is RunStatus.RELEASED
        clock.advance("30s")
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == "job_1"
        assert calls == [step_token(runtime.environment, run.id, "submit-render-job")]
        assert seen == [Submission(job_id="job_1"), Submission(job_id="job_1")]
        step = await runtime.store.get_step(run.id, "submit-render-job")
        assert step.output == {"job_id": "job_1"} and step.attempt == 1 and step.token == calls[0]
        # Another run with the same task and payload gets its own step.
        await runtime.trigger(render, {})
        await runtime.execute_next()
        assert len(calls) == 2


async def test_step_failures_are_not_checkpointed_and_run_again_on_retry():
    calls: list[int] = []

    @task("flaky.step", retry=Retry(3, backoff="1s"))
    async def flaky(payload: dict, ctx: TaskContext):
        def submit(token: str):
            calls.append(ctx.attempt)
            if ctx.attempt == 1:
                raise RuntimeError("provider rejected")
            if ctx.attempt == 2:
                return {"job_id": 7}  # does not match the schema
            return {"job_id": "ok"}

        result = await ctx.step.run("submit", submit, output=Submission)
        return result.job_id

    runtime, clock = make_runtime(flaky)
    async with runtime:
        run = (await runtime.trigger(flaky, {})).run
        first = await runtime.execute_next()
        assert first.failure.code is ErrorCode.TASK_FAILED
        clock.advance("1s")
        second = await runtime.execute_next()
        assert second.failure.code is ErrorCode.TASK_OUTPUT_INVALID
        assert await runtime.store.get_step(run.id, "submit") is None
        clock.advance("1s")
        assert (await runtime.execute_next()).output == "ok"
        assert calls == [1, 2, 3]


async def test_steps_in_sync_handlers_and_plain_json_outputs():
    calls: list[str] = []

    @task("sync.steps")
    def handler(payload: dict, ctx: TaskContext):
        first = ctx.step.run("one", lambda token: calls.append(token) or [1, 2])
        again = ctx.step.run("one", lambda token: calls.append("again") or [9])
        return {"first": first, "again": again}

    runtime, _ = make_runtime(handler)
    async with runtime:
        await runtime.trigger(handler, {})
        run = await runtime.execute_next()
        assert run.output == {"first": [1, 2], "again": [1, 2]}
        assert len(calls) == 1


async def test_one_step_key_called_side_by_side_runs_its_fn_once():
    """Two calls of one key at once (asyncio.gather, a def handler's threads): the second waits for the
    first and returns what it stored, instead of running the side effect again (and failing the run with
    invariant_violation when the two outputs differ)."""
    import concurrent.futures
    import threading

    calls: list[str] = []

    async def submit(token: str) -> dict:
        calls.append("async")
        await asyncio.sleep(0.01)
        return {"job": len(calls)}

    def submit_blocking(token: str) -> dict:
        calls.append("def")
        threading.Event().wait(0.01)
        return {"job": len(calls)}

    @task("side.by.side")
    async def gathered(payload: dict, ctx: TaskContext):
        return await asyncio.gather(*(ctx.step.run("submit", submit) for _ in range(3)))

    @task("side.by.side.threads")
    def threaded(payload: dict, ctx: TaskContext):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda _: ctx.step.run("submit", submit_blocking), range(3)))

    runtime, _ = make_runtime(gathered, threaded)
    async with runtime:
        for definition in (gathered, threaded):
            await runtime.trigger(definition, {})
            run = await runtime.execute_next()
            assert run.status is RunStatus.SUCCEEDED, run.failure
            assert run.output == [{"job": 1}] * 3
            assert len(calls) == 1
            calls.clear()


async def test_an_async_handler_calls_a_step_key_awaited_and_from_a_thread_alike():
    """A key an async def handler calls both awaited and from a thread it gives work to
    (``asyncio.to_thread(ctx.step.run, ...)``), in turn or at once, runs its fn once and replays what it
    stored, instead of failing the attempt with a TypeError from the other call's kind of lock."""
    calls: list[str] = []

    def submit(token: str) -> dict:
        calls.append(token)
        return {"job": len(calls)}

    @task("steps.loop.and.thread")
    async def mixed(payload: dict, ctx: TaskContext):
        first = await ctx.step.run("first", submit)
        first_again = await asyncio.to_thread(ctx.step.run, "first", submit)
        second = await asyncio.to_thread(ctx.step.run, "second", submit)
        second_again = await ctx.step.run("second", submit)
        together = await asyncio.gather(
            ctx.step.run("third", submit),
            asyncio.to_thread(ctx.step.run, "third", submit),
            ctx.step.run("third", submit),
        )
        return [first, first_again, second, second_again, *together]

    runtime, _ = make_runtime(mixed)
    async with runtime:
        await runtime.trigger(mixed, {})
        run = await asyncio.wait_for(runtime.execute_next(), 10)
    assert run.status is RunStatus.SUCCEEDED, run.failure
    assert run.output == [{"job": 1}] * 2 + [{"job": 2}] * 2 + [{"job": 3}] * 3
    assert len(calls) == 3


@pytest.mark.parametrize("kind", ["async", "def"])
async def test_a_step_called_inside_its_own_fn_is_refused_instead_of_waiting_for_itself(kind):
    if kind == "async":

        @task("nested.step")
        async def nested(payload: dict, ctx: TaskContext):
            async def outer(token: str) -> int:
                return await ctx.step.run("same", lambda token: 1)

            return await ctx.step.run("same", outer)

    else:

        @task("nested.step")
        def nested(payload: dict, ctx: TaskContext):
            return ctx.step.run("same", lambda token: ctx.step.run("same", lambda token: 1))

    runtime, _ = make_runtime(nested)
    async with runtime:
        await runtime.trigger(nested, {})
        run = await asyncio.wait_for(runtime.execute_next(), 10)
    assert run.status is RunStatus.FAILED and run.failure.code is ErrorCode.CONFIGURATION_INVALID


async def test_a_step_an_earlier_release_stored_under_its_long_key_itself_is_replayed_listed_and_pruned():
    """A step key past 512 bytes is stored by its digest; a step an earlier release stored under the key
    itself (in a run released before the upgrade) is still found: its fn is not called again."""
    from runlane.core.store import run_step_key
    from runlane.storage import NewStorageRecord, StorageIndexEntry, StorageRecordKey

    key = "\u4e2d" * 300  # 900 bytes of UTF-8
    calls: list[str] = []

    @task("long.step")
    async def handler(payload: dict, ctx: TaskContext):
        job = await ctx.step.run(key, lambda token: calls.append(token) or {"job_id": "j1"})
        if ctx.attempt == 1:
            return ctx.release("1s")
        return job

    runtime, clock = make_runtime(handler)
    async with runtime:
        run = await runtime.run_now(handler, {})
        assert run.status is RunStatus.RELEASED
        stored = run_step_key(runtime.store.env_key, run.id, key)
        legacy = StorageRecordKey(stored.collection, *stored.parts[:-1], key)
        assert stored != legacy

        async def store_as_before(tx):
            (record,) = await tx.get([stored])
            (entry,) = record.indexes
            tx.delete(record)
            indexes = [StorageIndexEntry(entry.name, entry.partition, (key,))]
            tx.create(NewStorageRecord(legacy, record.document, indexes))

        await runtime.lane.storage.with_transaction(store_as_before)
        clock.advance("1s")
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == {"job_id": "j1"} and len(calls) == 1
        assert (await runtime.runs.step(run.id, key)).output == {"job_id": "j1"}
        assert [step.step_key for step in (await runtime.runs.steps(run.id)).data] == [key]
        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1
        assert await runtime.lane.storage.get([stored, legacy]) == [None, None]


async def test_step_completion_is_fenced_and_conflicting_output_is_an_invariant_violation():
    outcomes: dict = {}

    @task("fenced")
    async def fenced(payload: dict, ctx: TaskContext):
        await ctx.step.run("k", lambda token: {"v": 1})
        current = await runtime.runs.get(ctx.run_id)
        token = step_token(ctx.environment, ctx.run_id, "k")
        same, created = await runtime.store.complete_step(ctx.run_id, "k", token, current.lease.token, ctx.attempt, {"v": 1})
        outcomes["same_created"] = created
        try:
            await runtime.store.complete_step(ctx.run_id, "k", token, current.lease.token, ctx.attempt, {"v": 2})
        except RunlaneError as error:
            outcomes["different"] = error.code
        try:
            await runtime.store.complete_step(ctx.run_id, "other", "t", "not-the-lease", ctx.attempt, {})
        except RunlaneError as error:
            outcomes["fenced"] = error.code

    runtime, _ = make_runtime(fenced)
    async with runtime:
        await runtime.trigger(fenced, {})
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert outcomes == {
            "same_created": False,
            "different": ErrorCode.INVARIANT_VIOLATION,
            "fenced": ErrorCode.STORAGE_CONFLICT,
        }


@pytest.mark.parametrize("key", ["", "a:b", 5])
async def test_invalid_step_keys_fail_the_attempt(key):
    @task("bad.step")
    async def bad(payload: dict, ctx: TaskContext):
        await ctx.step.run(key, lambda token: 1)

    runtime, _ = make_runtime(bad)
    async with runtime:
        await runtime.trigger(bad, {})
        assert (await runtime.execute_next()).failure.code is ErrorCode.CONFIGURATION_INVALID


async def test_steps_completing_together_keep_their_own_outcomes():
    # Gathered steps share a transaction, each with its own outcome; a repeated key waits for the call
    # before it and returns what that one stored, whatever its own fn would have returned (its fn is not
    # called, as in a later attempt). Storage refusing a second output is test_step_completion_is_fenced.
    outcomes: list[Any] = []

    @task("gathered.steps", retry=Retry(1))
    async def gathered(payload: dict, ctx: TaskContext):
        outcomes.extend(
            await asyncio.gather(
                ctx.step.run("a", lambda token: {"v": 1}),
                ctx.step.run("a", lambda token: {"v": 1}),
                ctx.step.run("b", lambda token: {"v": 2}),
                ctx.step.run("b", lambda token: {"v": 3}),
                ctx.step.run("c", lambda token: {"v": 4}),
                ctx.step.run("d", lambda token: 1 / 0),
                return_exceptions=True,
            )
        )

    runtime, _ = make_runtime(gathered)
    async with runtime:
        run = (await runtime.trigger(gathered, {})).run
        await runtime.execute_next()
        stored = {step.step_key: step.output for step in (await runtime.runs.steps(run.id)).data}
    assert outcomes[:5] == [{"v": 1}, {"v": 1}, {"v": 2}, {"v": 2}, {"v": 4}]
    assert isinstance(outcomes[5], ZeroDivisionError)
    assert stored == {"a": {"v": 1}, "b": {"v": 2}, "c": {"v": 4}}


async def test_first_step_completion_is_observed_once():
    observations = []

    @task("observed.step")
    async def observed(payload: dict, ctx: TaskContext):
        await ctx.step.run("s", lambda token: {"secret": "do-not-leak"})
        await ctx.step.run("s", lambda token: {"secret": "do-not-leak"})

    runtime, _ = make_runtime(observed, observers=[observations.append])
    async with runtime:
        run = (await runtime.trigger(observed, {})).run
        await runtime.execute_next()
    steps = [o for o in observations if o.type is RunlaneObservationType.RUN_STEP]
    assert len(steps) == 1
    assert steps[0].step_key == "s" and steps[0].attempt == 1 and steps[0].run_id == run.id
    assert steps[0].step_token == step_token(runtime.environment, run.id, "s")
    assert "do-not-leak" not in steps[0].model_dump_json()


class Upload(BaseModel):
    key: str
    sha256: bytes  # a raw digest is not UTF-8, so it has no JSON string


@pytest.mark.parametrize(
    ("returned", "output", "problem"),
    [
        # Not stored as null:
        (lambda token: {"ratio": float("nan")}, None, "(no NaN or Infinity) at $.ratio)"),
        (lambda token: {"ratio": float("nan")}, dict, "NaN or infinite"),
        (lambda token: Upload(key="k", sha256=hashlib.sha256(b"x").digest()), Upload, "cannot be stored as JSON"),
    ],
    ids=["nan", "nan-with-schema", "non-utf8-bytes"],
)
async def test_a_step_output_json_cannot_hold_is_task_output_invalid_naming_the_step(returned, output, problem):
    caught: list[RunlaneError] = []

    @task("steps.unstorable")
    async def unstorable(payload: dict, ctx: TaskContext) -> str:
        try:
            await ctx.step.run("measure", returned, output=output)
        except RunlaneError as error:
            caught.append(error)
        return "done"

    runtime, _ = make_runtime(unstorable)
    async with runtime:
        await runtime.trigger(unstorable, {})
        run = await runtime.execute_next()
        assert run.status is RunStatus.SUCCEEDED
        [error] = caught
        assert error.code is ErrorCode.TASK_OUTPUT_INVALID and error.meta["step_key"] == "measure"
        assert problem in error.message


class Placement(BaseModel):
    job_id: int
    region: str


async def test_a_step_output_its_schema_refuses_names_the_fields_in_the_message_and_meta():
    """The message and ``meta`` say where and why the output does not fit (as for a payload), not only
    pydantic's "2 validation errors for Placement"; ``meta`` keeps no value and is stored with the failure."""
    caught: list[RunlaneError] = []

    @task("steps.misfit")
    async def misfit(payload: dict, ctx: TaskContext) -> None:
        schema: Any = Placement if payload["model"] else int
        returned: Any = {"job_id": "secret-123"} if payload["model"] else "secret-456"
        try:
            await ctx.step.run("place", lambda token: returned, output=schema)
        except RunlaneError as error:
            caught.append(error)
            raise

    runtime, _ = make_runtime(misfit)
    async with runtime:
        run = await runtime.run_now(misfit, {"model": True})
        whole = await runtime.run_now(misfit, {"model": False})
        assert await runtime.runs.step(run.id, "place") is None
    assert run.failure is not None and run.failure.code is ErrorCode.TASK_OUTPUT_INVALID
    assert run.failure.meta == {
        "step_key": "place",
        "error_count": 2,
        "errors": [
            {
                "type": "int_parsing",
                "loc": ["job_id"],
                "msg": "Input should be a valid integer, unable to parse string as an integer",
            },
            {"type": "missing", "loc": ["region"], "msg": "Field required"},
        ],
    }
    error, whole_error = caught
    assert "job_id: Input should be a valid integer" in error.message and "region: Field required" in error.message
    assert "output: Input should be a valid integer" in whole_error.message
    assert "secret" not in json.dumps(run.failure.meta) + json.dumps(whole.failure.meta if whole.failure else None)


async def test_a_transforming_output_schema_returns_the_same_parsed_value_on_every_attempt():
    from datetime import UTC, datetime
    from typing import Annotated

    from pydantic import AfterValidator

    Normalized = Annotated[str, AfterValidator(str.lower)]  # idempotent: lowering twice changes nothing
    seen: list[tuple[int, Any]] = []

    @task("steps.normalize", retry=Retry(max_attempts=2, backoff="1s"))
    async def normalize(payload: dict, ctx: TaskContext) -> None:
        name = await ctx.step.run("name", lambda token: "Export-42", output=Normalized)
        at = await ctx.step.run("at", lambda token: "2026-11-30T08:00:00Z", output=datetime)
        seen.append((ctx.attempt, (name, at)))
        if ctx.attempt == 1:
            raise RuntimeError("poll again")

    runtime, clock = make_runtime(normalize)
    async with runtime:
        await runtime.trigger(normalize, {})
        assert (await runtime.execute_next()).status is RunStatus.RETRYING
        clock.advance("1s")
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
    expected = ("export-42", datetime(2026, 11, 30, 8, tzinfo=UTC))
    assert seen == [(1, expected), (2, expected)]


class Receipt(BaseModel):
    lines: Any


async def test_an_output_model_with_a_tuple_under_an_untyped_field_gives_every_attempt_the_stored_array():
    seen: list[tuple[int, Receipt]] = []

    @task("steps.receipt", retry=Retry(max_attempts=2, backoff="1s"))
    async def receipt(payload: dict, ctx: TaskContext) -> None:
        seen.append((ctx.attempt, await ctx.step.run("print", lambda token: Receipt(lines=(1, 2)), output=Receipt)))
        if ctx.attempt == 1:
            raise RuntimeError("poll again")

    runtime, clock = make_runtime(receipt)
    async with runtime:
        run = (await runtime.trigger(receipt, {})).run
        assert (await runtime.execute_next()).status is RunStatus.RETRYING
        clock.advance("1s")
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert (await runtime.store.get_step(run.id, "print")).output == {"lines": [1, 2]}
    assert seen == [(1, Receipt(lines=[1, 2])), (2, Receipt(lines=[1, 2]))]


async def test_an_output_schema_that_changes_its_own_output_is_refused_before_anything_is_stored():
    from typing import Annotated

    from pydantic import AfterValidator

    Doubled = Annotated[int, AfterValidator(lambda value: value * 2)]  # 5 -> 10, and 10 would give 20

    @task("steps.doubled")
    async def doubled(payload: dict, ctx: TaskContext) -> int:
        return await ctx.step.run("count", lambda token: 5, output=Doubled)

    runtime, _ = make_runtime(doubled)
    async with runtime:
        run = (await runtime.trigger(doubled, {})).run
        done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert done.failure.meta == {"step_key": "count"}
        assert await runtime.store.get_step(run.id, "count") is None


@pytest.mark.parametrize("output", ["Submission", list["Submission"]])
async def test_an_output_schema_naming_a_type_it_cannot_resolve_fails_before_fn_runs(output, caplog):
    """pydantic resolves a string (forward reference) only on first use, which came after ``fn``'s side
    effect and failed as a retryable task_failed, so every retry repeated the side effect."""
    calls: list[str] = []

    @task("steps.unresolved", retry=Retry(3, backoff="1s"))
    async def unresolved(payload: dict, ctx: TaskContext) -> None:
        await ctx.step.run("submit", lambda token: calls.append(token) or {"job_id": "j1"}, output=output)

    runtime, _ = make_runtime(unresolved)
    async with runtime:
        run = (await runtime.trigger(unresolved, {})).run
        done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert done.failure.meta == {"field": "output"}
        assert calls == [] and await runtime.store.get_step(run.id, "submit") is None
    assert "name 'Submission' is not defined" in caplog.text


@pytest.mark.parametrize("lossy", ["secret", "excluded"])
async def test_an_output_schema_that_leaves_a_value_out_of_what_it_stores_is_refused(lossy):
    from pydantic import Field, SecretStr

    class WithSecret(BaseModel):
        job_id: str
        api_token: SecretStr  # stored as '**********': a replay would get that instead of the token

    class WithExcluded(BaseModel):
        job_id: str
        status_url: str = Field(default="", exclude=True)  # never stored: a replay would get ''

    schema = WithSecret if lossy == "secret" else WithExcluded
    value = {"job_id": "j1", "api_token": "real-token", "status_url": "https://p/j1"}

    @task("steps.lossy")
    async def submit(payload: dict, ctx: TaskContext) -> None:
        fields = {key: item for key, item in value.items() if key in schema.model_fields}
        await ctx.step.run("submit", lambda token: fields, output=schema)

    runtime, _ = make_runtime(submit)
    async with runtime:
        run = (await runtime.trigger(submit, {})).run
        done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert await runtime.store.get_step(run.id, "submit") is None


async def test_an_output_model_with_field_aliases_is_stored_by_alias_and_replayed():
    from pydantic import Field

    class Submission(BaseModel):
        job_id: str = Field(alias="jobId")

    submitted: list[str] = []
    seen: list[Submission] = []

    def submit(token: str) -> dict:
        submitted.append(token)
        return {"jobId": "J1"}

    @task("steps.aliased", retry=Retry(max_attempts=2, backoff="1s"))
    async def aliased(payload: dict, ctx: TaskContext) -> str:
        seen.append(await ctx.step.run("submit", submit, output=Submission))
        if ctx.attempt == 1:
            raise RuntimeError("poll again")
        return seen[-1].job_id

    runtime, clock = make_runtime(aliased)
    async with runtime:
        run = (await runtime.trigger(aliased, {})).run
        assert (await runtime.execute_next()).status is RunStatus.RETRYING
        clock.advance("1s")
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == "J1"
        assert (await runtime.store.get_step(run.id, "submit")).output == {"jobId": "J1"}
    assert len(submitted) == 1  # the side effect happened once; the retry replayed the checkpoint
    assert seen == [Submission(jobId="J1"), Submission(jobId="J1")]


async def test_a_forgotten_await_fails_the_run_instead_of_silently_skipping_the_work(caplog):
    """In an ``async def`` handler ``ctx.step.run``, ``ctx.trigger`` and ``ctx.get_run`` return awaitables:
    one never awaited did nothing, so the attempt fails (once, not retried) and says which call it was."""
    calls: list[str] = []

    @task("orders.child")
    async def child(payload: dict) -> None:
        return None

    @task("orders.place", retry=Retry(3, backoff="1s"))
    async def place(payload: dict, ctx: TaskContext) -> str:
        ctx.step.run("charge", calls.append)  # no await: the charge never happens
        ctx.trigger(child, {"order": "o1"})  # no await: no child run
        return "placed"

    runtime, _ = make_runtime(place, child)
    async with runtime:
        await runtime.trigger(place, {})
        with caplog.at_level("ERROR", logger="runlane.tasks"):
            done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert done.failure.meta == {"calls": ["ctx.step.run('charge')", "ctx.trigger('orders.child')"]}
        assert calls == [] and [run.task_id for run in (await runtime.runs.list()).data] == ["orders.place"]
        assert "returned without awaiting ctx.step.run('charge'), ctx.trigger('orders.child')" in caplog.text
        assert "await them" in caplog.text


async def test_awaited_gathered_and_task_wrapped_ctx_calls_are_not_reported():
    @task("orders.child")
    async def child(payload: dict) -> None:
        return None

    @task("orders.fan_out")
    async def fan_out(payload: dict, ctx: TaskContext) -> list[str]:
        first = await ctx.step.run("first", lambda token: "a")
        second, third = await asyncio.gather(ctx.step.run("second", lambda t: "b"), ctx.get_run(ctx.run_id))
        spawned = asyncio.ensure_future(ctx.trigger(child, {}))  # started at the handler's return, awaited nowhere
        del spawned
        return [first, second, third.id]

    runtime, _ = make_runtime(fan_out, child)
    async with runtime:
        run = (await runtime.trigger(fan_out, {})).run
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == ["a", "b", run.id]


# ---------------------------------------------------------------------------------------------
# A handler that goes on after its attempt can no longer act for the run


def _stale_probe(ctx: TaskContext, calls: list[str], child: Any) -> list[tuple[str, Any]]:
    """What a step and a child trigger of ``ctx`` come to: each refused before ``fn`` runs or a run is made."""
    refusals: list[tuple[str, Any]] = []

    def side_effect(token: str) -> str:
        calls.append("fn")
        return "charged"

    attempts = (("step", lambda: ctx.step.run("charge", side_effect)), ("trigger", lambda: ctx.trigger(child, {})))
    for what, call in attempts:
        try:
            call()
        except RunlaneError as error:
            refusals.append((what, error.meta.get("storage_conflict_kind")))
    return refusals


def test_a_context_a_thread_kept_past_its_runtime_refuses_its_calls_as_lease_ownership() -> None:
    """A ``def`` handler's ``ctx`` used by a thread after its runtime closed and the loop that ran it is gone
    is refused as any ``ctx`` kept past its attempt is (``storage_conflict``, ``lease_ownership``), instead
    of failing with the loop's ``RuntimeError('Event loop is closed')``."""
    import threading

    kept: list[TaskContext] = []

    @task("kept.context")
    def keep(payload: dict, ctx: TaskContext) -> str:
        kept.append(ctx)
        return ctx.step.run("charge", lambda token: "charged")

    async def execute() -> None:
        runtime, _ = make_runtime(keep)
        async with runtime:
            await runtime.trigger(keep, {})
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED

    asyncio.run(execute())
    [ctx] = kept
    calls = {
        "replayed step": lambda: ctx.step.run("charge", lambda token: "charged"),
        "new step": lambda: ctx.step.run("refund", lambda token: "refunded"),
        "trigger": lambda: ctx.trigger(keep, {}),
        "get_run": lambda: ctx.get_run(ctx.run_id),
    }
    refused: dict[str, Any] = {}

    def use() -> None:
        for what, call in calls.items():
            try:
                refused[what] = call()
            except Exception as error:  # noqa: BLE001 - the error is what the test checks
                refused[what] = error

    thread = threading.Thread(target=use)
    thread.start()
    thread.join(10)
    assert set(refused) == set(calls)
    for what, error in refused.items():
        assert isinstance(error, RunlaneError), (what, error)
        assert error.meta.get("storage_conflict_kind") == "lease_ownership", (what, error)


@pytest.mark.parametrize("ending", ["timeout recorded by tick", "cancellation finalized by tick"])
async def test_a_handler_going_on_after_maintenance_ended_its_attempt_neither_calls_fn_nor_creates_runs(
    ending: str,
) -> None:
    """A ``def`` handler blocked past its deadline (or ignoring a cancellation until its lease ran out)
    while maintenance recorded the attempt's end: its later step would run a side effect whose output is
    thrown away (and run again by the next attempt), its child would hang off an ended attempt."""
    import threading

    go = threading.Event()
    calls: list[str] = []
    refused: list[list[tuple[str, Any]]] = []

    @task("stale.child")
    def child(payload: dict) -> None:
        return None

    @task("stale.charge", retry=Retry(3, backoff="1m"), max_attempt_duration="10s")
    def charge(payload: dict, ctx: TaskContext) -> str:
        if ctx.attempt == 1:
            go.wait(10)  # blocked (a slow call), not watching ctx.signal
            refused.append(_stale_probe(ctx, calls, child))
        return "done"

    runtime, clock = make_runtime(charge, child)
    async with runtime:
        run = (await runtime.trigger(charge, {})).run
        attempt = asyncio.ensure_future(runtime.execute_next())
        for _ in range(200):
            if (await runtime.runs.get(run.id)).status is RunStatus.RUNNING:
                break
            await asyncio.sleep(0.005)
        if ending == "timeout recorded by tick":
            clock.advance("12s")
            assert (await runtime.tick()).timeouts_finalized == 1
        else:
            await runtime.runs.cancel(run.id)
            clock.advance("6m")  # past the lease, no longer extended once the cancellation was seen
            assert (await runtime.tick()).cancellations_finalized == 1
        go.set()
        await asyncio.wait_for(attempt, 10)
        assert refused == [[("step", "lease_ownership"), ("trigger", "lease_ownership")]]
        assert calls == []  # the side effect never ran for the ended attempt
        assert await runtime.runs.step(run.id, "charge") is None
        assert [summary.task_id for summary in (await runtime.runs.list()).data] == ["stale.charge"]


async def test_a_step_still_running_when_a_gathered_sibling_fails_stores_its_output_before_the_retry() -> None:
    """Steps side by side in ``asyncio.gather``: one fails, the attempt's handler raises at once, and the
    other is still doing its work. That work is stored when it ends, not done again by the next attempt."""
    calls: list[tuple[str, int]] = []
    slow_may_finish = asyncio.Event()

    @task("steps.side_by_side", retry=Retry(2, backoff="1s"))
    async def side_by_side(payload: dict, ctx: TaskContext) -> list[str]:
        async def slow(token: str) -> str:
            calls.append(("slow", ctx.attempt))
            await slow_may_finish.wait()
            return "slow done"

        def failing(token: str) -> str:
            calls.append(("failing", ctx.attempt))
            if ctx.attempt == 1:
                raise ConnectionError("provider unavailable")
            return "failing done"

        return await asyncio.gather(ctx.step.run("slow", slow), ctx.step.run("failing", failing))

    runtime, clock = make_runtime(side_by_side)
    async with runtime:
        run = (await runtime.trigger(side_by_side, {})).run
        first = asyncio.ensure_future(runtime.execute_next())
        for _ in range(200):
            if ("failing", 1) in calls:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert not first.done()  # the attempt waits for the step it left running
        slow_may_finish.set()
        assert (await asyncio.wait_for(first, 10)).status is RunStatus.RETRYING
        assert (await runtime.runs.step(run.id, "slow")).output == "slow done"
        clock.advance("1s")
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == ["slow done", "failing done"]
    assert calls == [("slow", 1), ("failing", 1), ("failing", 2)]  # the slow work ran once


class _HeldWriteDriver:
    """The local driver, holding its next transaction (a step write) until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name
        self.profile = inner.profile
        self.hold_next = False
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def with_transaction(self, callback: Any) -> Any:
        if self.hold_next:
            self.hold_next = False
            self.holding.set()
            await self.release.wait()
        return await self._inner.with_transaction(callback)


async def test_a_step_whose_write_a_task_group_cancels_is_stored_observed_and_not_run_again() -> None:
    """Steps in an ``asyncio.TaskGroup``: one step's fn has done its work and its output is being written
    when a sibling fails and the group cancels it. The output is still stored (and observed), not thrown away
    for the next attempt to do the work again."""
    from runlane import create_runlane
    from runlane.core.lanes import LaneDelivery, create_lane
    from runlane.testing import ControlledClock
    from runlane.vocabulary import LaneDeliveryMode
    from runlane_local import local_storage_driver

    from runtime_support import DEFAULT_QUEUE

    driver = _HeldWriteDriver(local_storage_driver())
    calls: list[tuple[str, int]] = []

    @task("steps.task_group", retry=Retry(2, backoff="1s"))
    async def grouped(payload: dict, ctx: TaskContext) -> str:
        def charge(token: str) -> str:
            calls.append(("charge", ctx.attempt))
            driver.hold_next = True  # its write is held in storage while the sibling fails
            return "charged"

        async def notify(token: str) -> str:
            if ctx.attempt == 1:
                await driver.holding.wait()
                asyncio.get_running_loop().call_soon(driver.release.set)  # once the group has cancelled charge
                raise ConnectionError("provider unavailable")
            return "notified"

        async with asyncio.TaskGroup() as group:
            charged = group.create_task(ctx.step.run("charge", charge))
            group.create_task(ctx.step.run("notify", notify))
        return charged.result()

    observed: list[Any] = []
    clock = ControlledClock()
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(
        lane=lane, queues=[DEFAULT_QUEUE], tasks=[grouped], clock=clock, observers=[observed.append]
    )
    async with runtime:
        run = (await runtime.trigger(grouped, {})).run
        assert (await asyncio.wait_for(runtime.execute_next(), 10)).status is RunStatus.RETRYING
        assert (await runtime.runs.step(run.id, "charge")).output == "charged"
        assert [o.step_key for o in observed if o.type is RunlaneObservationType.RUN_STEP] == ["charge"]
        clock.advance("1s")
        done = await asyncio.wait_for(runtime.execute_next(), 10)
        assert done.status is RunStatus.SUCCEEDED and done.output == "charged"
    assert calls == [("charge", 1)]  # the charge ran once
