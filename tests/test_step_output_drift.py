"""A durable step whose stored output no longer matches its ``output=`` schema (a deploy changed it)."""

from __future__ import annotations

import time

import pytest
from pydantic import BaseModel, field_validator

from runlane import ErrorCode, RunStatus, TaskContext, task

from runtime_support import shared_runtimes


class SubmittedV1(BaseModel):
    job_id: str


class SubmittedV2(BaseModel):  # the next deploy's: a job id is a number now, and the step says when it ran
    job_id: int
    submitted_at: float


def submit_v1(token: str) -> dict:
    return {"job_id": "job_1"}


def submit_v2(token: str) -> dict:
    return {"job_id": 1, "submitted_at": time.time()}


@task("orders.submit")
async def before(payload: dict, ctx: TaskContext):
    await ctx.step.run("submit", submit_v1, output=SubmittedV1)
    return ctx.wait_for_signal("orders.ready")


@task("orders.submit")
async def after_async(payload: dict, ctx: TaskContext):
    submitted = await ctx.step.run("submit", submit_v2, output=SubmittedV2)
    return submitted.job_id


@task("orders.submit")
def after_def(payload: dict, ctx: TaskContext):
    return ctx.step.run("submit", submit_v2, output=SubmittedV2).job_id


EXPECTED_MESSAGE = (
    "The stored output of step 'submit' no longer matches its output schema: job_id: Input should be a valid "
    "integer, unable to parse string as an integer; submitted_at: Field required. It was stored under an "
)


@pytest.mark.parametrize("after", [after_async, after_def], ids=["async", "def"])
async def test_a_step_output_that_no_longer_validates_fails_the_run_with_a_message_saying_so(after) -> None:
    (old, new), _ = shared_runtimes([before], [after])  # the same runs, before and after the deploy
    async with old, new:
        run = (await old.trigger(before, {})).run
        assert (await old.execute_next()).status is RunStatus.RELEASED
        assert [resumed.id for resumed in await new.signals.send("orders.ready")] == [run.id]
        failed = await new.execute_next()
        assert failed is not None and failed.status is RunStatus.FAILED
        failure = failed.failure
        assert failure is not None and failure.code is ErrorCode.VALIDATION_FAILED and not failure.retryable
        assert failure.message.startswith(EXPECTED_MESSAGE), failure.message
        assert failure.meta == {
            "step_key": "submit",
            "error_count": 2,
            "errors": [
                {
                    "type": "int_parsing",
                    "loc": ["job_id"],
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                },
                {"type": "missing", "loc": ["submitted_at"], "msg": "Field required"},
            ],
        }
        # The stored output itself is kept, for whoever decides what to do with the run.
        stored = await new.runs.step(run.id, "submit")
        assert stored is not None and stored.output == {"job_id": "job_1"}


class SubmittedV3(BaseModel):  # a validator that raises KeyError, not ValueError, on what V1 stored
    job_id: int

    @field_validator("job_id", mode="before")
    @classmethod
    def from_reference(cls, value: object) -> object:
        return {"job-1": 1}[value] if isinstance(value, str) else value  # V1 stored "job_1"


@task("orders.submit")
async def after_raising(payload: dict, ctx: TaskContext):
    return (await ctx.step.run("submit", submit_v2, output=SubmittedV3)).job_id


async def test_a_step_output_schema_raising_on_the_stored_output_fails_the_run_like_any_drift() -> None:
    (old, new), _ = shared_runtimes([before], [after_raising])
    async with old, new:
        run = (await old.trigger(before, {})).run
        assert (await old.execute_next()).status is RunStatus.RELEASED
        await new.signals.send("orders.ready")
        failed = await new.execute_next()
        failure = failed.failure
        assert failed.status is RunStatus.FAILED and failure is not None
        # Not task_failed, retried to the end of the budget: every attempt reads the same stored output.
        assert failure.code is ErrorCode.VALIDATION_FAILED and not failure.retryable
        assert failure.message.startswith(
            "The stored output of step 'submit' no longer matches its output schema: its validation raised KeyError."
        ), failure.message
        assert failure.meta == {"step_key": "submit", "error_type": "KeyError", "error_count": 0, "errors": []}
        assert (await new.runs.step(run.id, "submit")).output == {"job_id": "job_1"}
