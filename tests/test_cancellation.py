"""Cancellation signals: state, thread-safe wake-ups of coroutines and threads, callbacks and linking."""

import asyncio
import logging
import threading

import pytest

from runlane import ErrorCode, RunlaneError
from runlane.core.cancellation import CancellationController, CancellationSignal, link_signals

WAIT = 5  # seconds; generous so a slow machine never flakes, a hang still fails


def test_a_new_signal_is_active():
    signal = CancellationController().signal
    assert isinstance(signal, CancellationSignal)
    assert signal.aborted is False and signal.reason is None
    signal.raise_if_aborted()
    assert signal.wait_sync(0) is False
    assert "active" in repr(signal)


def test_abort_is_idempotent_and_keeps_the_first_reason():
    controller = CancellationController()
    assert controller.abort("cancellation_requested") is True
    assert controller.abort("attempt_timed_out") is False
    assert controller.signal.aborted is True
    assert controller.signal.reason == "cancellation_requested"


def test_raise_if_aborted_raises_operation_cancelled_with_the_reason():
    controller = CancellationController()
    controller.abort("worker_stopping")
    with pytest.raises(RunlaneError) as caught:
        controller.signal.raise_if_aborted()
    assert caught.value.code is ErrorCode.OPERATION_CANCELLED
    assert caught.value.meta == {"reason": "worker_stopping"}
    assert "worker_stopping" in caught.value.message


def test_abort_without_a_reason():
    controller = CancellationController()
    controller.abort()
    with pytest.raises(RunlaneError) as caught:
        controller.signal.raise_if_aborted()
    assert caught.value.code is ErrorCode.OPERATION_CANCELLED and caught.value.meta == {}


def test_abort_reason_must_be_text():
    with pytest.raises(RunlaneError) as caught:
        CancellationController().abort(42)  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_abort_from_another_thread_wakes_an_awaiting_coroutine():
    controller = CancellationController()
    waiter = asyncio.create_task(controller.signal.wait())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    thread = threading.Thread(target=controller.abort, args=("from_thread",))
    thread.start()
    await asyncio.wait_for(waiter, WAIT)
    thread.join(WAIT)
    assert controller.signal.reason == "from_thread"


async def test_abort_on_the_loop_wakes_every_waiter():
    controller = CancellationController()
    waiters = [asyncio.create_task(controller.signal.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    controller.abort()
    await asyncio.wait_for(asyncio.gather(*waiters), WAIT)


async def test_wait_returns_at_once_when_already_aborted():
    controller = CancellationController()
    controller.abort()
    await asyncio.wait_for(controller.signal.wait(), WAIT)


async def test_a_cancelled_waiter_does_not_break_a_later_abort():
    controller = CancellationController()
    waiter = asyncio.create_task(controller.signal.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert controller.abort() is True


def test_waiters_on_another_event_loop_are_woken():
    controller = CancellationController()
    ready = threading.Event()
    woken = threading.Event()

    async def wait_on_own_loop():
        task = asyncio.create_task(controller.signal.wait())
        await asyncio.sleep(0)
        ready.set()
        await asyncio.wait_for(task, WAIT)
        woken.set()

    thread = threading.Thread(target=asyncio.run, args=(wait_on_own_loop(),))
    thread.start()
    assert ready.wait(WAIT)
    controller.abort()
    thread.join(WAIT)
    assert woken.is_set()


async def test_a_sync_handler_in_a_worker_thread_sees_an_abort_from_the_loop():
    controller = CancellationController()
    started = threading.Event()

    def sync_handler() -> str:
        started.set()
        if not controller.signal.wait_sync(WAIT):
            return "timed out"
        controller.signal.raise_if_aborted()
        return "unreachable"

    worker = asyncio.create_task(asyncio.to_thread(sync_handler))
    assert await asyncio.to_thread(started.wait, WAIT)
    controller.abort("cancellation_requested")
    with pytest.raises(RunlaneError) as caught:
        await asyncio.wait_for(worker, WAIT)
    assert caught.value.code is ErrorCode.OPERATION_CANCELLED


def test_wait_sync_times_out_while_active():
    assert CancellationController().signal.wait_sync(0.01) is False


def test_callbacks_run_exactly_once_under_racing_aborts():
    controller = CancellationController()
    calls: list[str] = []
    lock = threading.Lock()

    def record(name: str):
        def callback():
            with lock:
                calls.append(name)

        return callback

    controller.signal.add_callback(record("first"))
    controller.signal.add_callback(record("second"))
    barrier = threading.Barrier(8)
    results: list[bool] = []

    def abort():
        barrier.wait()
        results.append(controller.abort("race"))

    threads = [threading.Thread(target=abort) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert sorted(calls) == ["first", "second"]
    assert results.count(True) == 1


def test_the_same_function_added_twice_runs_twice_and_each_can_be_removed():
    controller = CancellationController()
    calls: list[int] = []

    def callback():
        calls.append(1)

    controller.signal.add_callback(callback)
    remove = controller.signal.add_callback(callback)
    remove()
    remove()  # removing twice is harmless
    controller.abort()
    assert calls == [1]


def test_a_callback_added_after_abort_runs_immediately():
    controller = CancellationController()
    controller.abort("done")
    seen: list[str | None] = []
    remove = controller.signal.add_callback(lambda: seen.append(controller.signal.reason))
    assert seen == ["done"]
    remove()


def test_a_failing_callback_is_logged_and_does_not_stop_the_others(caplog):
    controller = CancellationController()
    calls: list[str] = []

    def broken():
        raise RuntimeError("boom")

    controller.signal.add_callback(broken)
    controller.signal.add_callback(lambda: calls.append("after"))
    with caplog.at_level(logging.ERROR, logger="runlane"):
        assert controller.abort() is True
    assert calls == ["after"]
    assert controller.signal.aborted
    assert [str(record.exc_info[1]) for record in caplog.records if record.exc_info] == ["boom"]


def test_add_callback_needs_a_function():
    with pytest.raises(RunlaneError) as caught:
        CancellationController().signal.add_callback("not callable")  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_linked_signal_aborts_when_any_parent_aborts_with_that_parents_reason():
    worker, caller = CancellationController(), CancellationController()
    linked = link_signals(worker.signal, caller.signal)
    assert linked.signal.aborted is False
    caller.abort("caller_gave_up")
    assert linked.signal.aborted is True
    assert linked.signal.reason == "caller_gave_up"
    assert worker.signal.aborted is False


def test_aborting_a_linked_signal_leaves_its_parents_alone():
    parent = CancellationController()
    linked = link_signals(parent.signal)
    linked.abort("attempt_timed_out")
    assert parent.signal.aborted is False
    parent.abort("worker_stopping")
    assert linked.signal.reason == "attempt_timed_out"


def test_linking_an_aborted_parent_aborts_at_once_and_none_is_skipped():
    parent = CancellationController()
    parent.abort("already")
    linked = link_signals(None, parent.signal)
    assert linked.signal.aborted and linked.signal.reason == "already"
    assert link_signals(None).signal.aborted is False


def test_unlink_stops_following_the_parents():
    parent = CancellationController()
    linked = link_signals(parent.signal)
    linked.unlink()
    parent.abort()
    assert linked.signal.aborted is False


async def test_a_linked_signal_wakes_its_waiters_when_a_parent_aborts_from_a_thread():
    parent = CancellationController()
    linked = link_signals(parent.signal)
    waiter = asyncio.create_task(linked.signal.wait())
    await asyncio.sleep(0)
    threading.Thread(target=parent.abort, args=("shutdown",)).start()
    await asyncio.wait_for(waiter, WAIT)
    assert linked.signal.reason == "shutdown"


def test_link_signals_takes_signals_only():
    with pytest.raises(RunlaneError) as caught:
        link_signals(CancellationController())  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_linked_controllers_are_freed_without_the_cycle_collector():
    import gc

    parent = CancellationController()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for n in range(50):
            child = link_signals(parent.signal)
            child.signal.add_callback(lambda: None)
            if n % 2:
                child.abort("done")  # an aborted child unlinks itself
            else:
                child.unlink()
        del child
        gc.collect()
        leaked = [item for item in gc.garbage if _cancellation_object(item)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert leaked == []
    assert not parent.signal.aborted


def _cancellation_object(item: object) -> bool:
    # ``type()``, not ``isinstance``: the garbage may hold weak proxies of other tests' objects, and
    # ``isinstance`` asks a dead one for its class (ReferenceError).
    return type(item) in (CancellationController, CancellationSignal)


async def test_executed_runs_leave_no_cancellation_objects_for_the_cycle_collector():
    import gc

    from runlane import WorkerMode, create_runlane, queue, task
    from runlane_local import local_lane

    work_queue = queue("cycles", default=True)

    @task("cycles.noop", queue=work_queue)
    async def noop(payload: dict, ctx) -> None:
        ctx.signal.raise_if_aborted()

    runtime = create_runlane(lane=local_lane(), queues=[work_queue], tasks=[noop])
    async with runtime:
        for n in range(40):
            await runtime.trigger(noop, {"n": n})
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await runtime.worker(mode=WorkerMode.DRAIN, concurrency=4).closed
            gc.collect()
            leaked = [item for item in gc.garbage if _cancellation_object(item)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert leaked == []
