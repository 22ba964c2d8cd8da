"""The running attempt as seen from code a handler calls: ``current_task_context()`` and
``RunContextFilter`` for the application's own logging."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from runlane import RunContextFilter, TaskContext, current_task_context, queue, task

from runtime_support import DEFAULT_QUEUE, make_runtime


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(RunContextFilter())
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def app_log() -> Any:
    logger = logging.getLogger("app.billing")
    collect = _Collect()
    logger.addHandler(collect)
    logger.setLevel(logging.INFO)
    try:
        yield logger, collect.records
    finally:
        logger.removeHandler(collect)


def _fields(record: logging.LogRecord) -> tuple[Any, ...]:
    fields = record.__dict__
    return (record.getMessage(), fields["run_id"], fields["task_id"], fields["attempt"], fields["queue"])


async def test_the_applications_log_lines_name_the_run_they_belong_to(app_log: Any) -> None:
    logger, records = app_log
    seen: list[Any] = []

    def charge(amount: int) -> None:  # a helper that takes no ctx
        context = current_task_context()
        seen.append(context)
        logger.info("charging %s", amount)

    @task("billing.async")
    async def in_async(payload: dict, ctx: TaskContext) -> None:
        charge(1)

        async def later() -> None:
            await asyncio.sleep(0)
            charge(2)

        await asyncio.create_task(later())  # a task the handler started

    @task("billing.sync")
    def in_thread(payload: dict) -> None:  # a def handler, on a thread of its own
        charge(3)

    runtime, _ = make_runtime(in_async, in_thread)
    async with runtime:
        first = (await runtime.trigger(in_async, {})).run
        second = (await runtime.trigger(in_thread, {})).run
        await runtime.execute_next()
        await runtime.execute_next()
    logger.info("outside any run")
    assert [_fields(record) for record in records] == [
        ("charging 1", first.id, "billing.async", 1, first.queue),
        ("charging 2", first.id, "billing.async", 1, first.queue),
        ("charging 3", second.id, "billing.sync", 1, second.queue),
        ("outside any run", None, None, None, None),
    ]
    assert all(isinstance(context, TaskContext) for context in seen)
    assert [context.run_id for context in seen] == [first.id, first.id, second.id]
    assert current_task_context() is None


async def test_current_task_context_is_the_handlers_own_ctx() -> None:
    same: list[bool] = []

    @task("context.same")
    async def handler(payload: dict, ctx: TaskContext) -> None:
        same.append(current_task_context() is ctx)

    runtime, _ = make_runtime(handler)
    async with runtime:
        await runtime.trigger(handler, {})
        await runtime.execute_next()
    assert same == [True]


def test_the_filter_keeps_fields_a_record_already_has_and_never_drops_one() -> None:
    record = logging.LogRecord("runlane.task", logging.WARNING, __file__, 1, "attempt failed", None, None)
    record.run_id = "run_given"
    assert RunContextFilter().filter(record) is True
    assert record.run_id == "run_given" and record.task_id is None  # type: ignore[attr-defined]



async def test_a_record_naming_another_run_gets_none_of_the_running_attempts_fields() -> None:
    collect = _Collect()
    observers_log = logging.getLogger("runlane.observers")
    observers_log.addHandler(collect)
    children = queue("context.children")

    def on_child(observation: Any) -> None:
        if observation.task_id == "context.child":
            raise RuntimeError("metrics backend down")

    @task("context.child", queue=children)
    async def child(payload: dict) -> None:
        return None

    @task("context.parent")
    async def parent(payload: dict, ctx: TaskContext) -> None:
        await ctx.trigger(child, {})  # the child's run.created is observed while this attempt runs

    runtime, _ = make_runtime(parent, child, queues=[DEFAULT_QUEUE, children], observers=[on_child])
    try:
        async with runtime:
            await runtime.trigger(parent, {})
            await runtime.execute_next(queues=[DEFAULT_QUEUE.name])
            [child_run] = (await runtime.runs.list(task_ids=["context.child"])).data
    finally:
        observers_log.removeHandler(collect)
    # The observer's failure names the child run: the parent attempt's number and queue are not the child's.
    assert [_fields(record)[1:] for record in collect.records] == [(child_run.id, "context.child", None, None)]
