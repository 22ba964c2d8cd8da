"""Operator commands over the ``runlane dev`` bridge, run from other processes.

One background ``runlane dev`` (the installed script) serves the whole module; every command below is a
separate ``runlane`` process whose result can only be right if it ran on the dev process's in-memory
lane (a command that fell back to its own runtime would see an empty store). The dev process ticks once
at startup and then only every hour, so a schedule occurrence appears only when ``runlane tick`` runs.
Tests create their own runs and never depend on each other's. Every wait is bounded.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from runlane.cli.bridge import Session, read_session

from cli_support import Project, command, make_project, post, running_dev, wait_for

TASKS = """
from pathlib import Path

from runlane import Retry, TaskContext, queue, schedule, task

ops = queue("ops", default=True)
held = queue("held")  # the dev worker does not poll it: its runs stay queued


@task("ops.echo", queue=ops)
def echo(payload: dict) -> dict:
    return {"echo": payload["n"]}


@task("ops.gated", queue=ops, retry=Retry(max_attempts=1))
def gated(payload: dict) -> dict:
    if not Path(payload["gate"]).exists():
        raise RuntimeError("the gate is closed")
    return {"passed": True}


@task("ops.waiter", queue=ops)
async def waiter(payload: dict, ctx: TaskContext):
    if ctx.attempt == 1:
        return ctx.wait_for_signal(payload["key"], reason="waiting for the operator")
    return {"resumed_on_attempt": ctx.attempt}


@task("ops.beat", queue=ops, schedule=schedule("ops.beat.every", every="1s"))
def beat() -> None:
    return None


@task("ops.parked", queue=held)
def parked(payload: dict) -> dict:
    return {}
"""


@dataclass(frozen=True)
class Dev:
    """The module's dev process. ``cli``/``json`` run a separate ``runlane`` process (the commands under
    test); ``ask`` posts straight to the bridge with the session token, a fast way to set up runs and
    to read the dev process's state between commands."""

    project: Project
    process: subprocess.Popen[str]
    session: Session

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = self.project.cli(*args)
        assert "stale runlane dev session" not in result.stderr, result.stderr  # it reached the dev process
        return result

    def json(self, *args: str) -> Any:
        result = self.cli("--json", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def ask(self, name: str, **params: Any) -> Any:
        status, answer = post(self.session.port, command(name, params), token=self.session.token)
        assert status == 200 and "error" not in answer, (name, params, status, answer)
        return json.loads(answer["stdout"])

    def refused(self, name: str, **params: Any) -> dict[str, Any]:
        """The error a command served by the bridge raised inside the dev process."""
        status, answer = post(self.session.port, command(name, params), token=self.session.token)
        assert status == 200 and "error" in answer, (name, params, status, answer)
        return answer["error"]

    def run(self, run_id: str) -> dict[str, Any]:
        return self.ask("runs get", run_id=run_id)["run"]

    def trigger(self, task_id: str, payload: dict[str, Any]) -> str:
        return self.ask("trigger", task_id=task_id, payload=payload)["run"]["id"]

    def settled(self, run_id: str, status: str, *, timeout: float = 20.0) -> dict[str, Any]:
        """The run once the dev process has moved it to ``status``."""
        return wait_for(
            lambda: (run := self.run(run_id))["status"] == status and run,
            timeout=timeout,
            what=f"run {run_id} to become {status}",
        )

    def failed_run(self) -> tuple[str, Path]:
        """A run of ``ops.gated`` that failed in the dev process, and the gate file that lets its work pass."""
        gate = self.project.tmpdir / f"gate-{uuid4().hex}"
        run_id = self.trigger("ops.gated", {"gate": str(gate)})
        self.settled(run_id, "failed")
        return run_id, gate


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dev]:
    """One ``runlane dev`` for the module, polling the ``ops`` queue and ticking once at startup."""
    base = tmp_path_factory.mktemp("bridge-operators")
    tmpdir = base / "tmp"
    tmpdir.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
        project = Project(make_project(base / "proj", TASKS), tmpdir)
        with running_dev(project, "--queue", "ops", "--tick-interval", "1h") as process:
            session = read_session(project.config)
            assert session is not None
            yield Dev(project, process, session)
            assert process.poll() is None, "the dev process ended during the module"


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (no traceback, nothing on stdout)."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------------------------------------


def test_tick_materializes_a_due_schedule_in_the_dev_process(dev: Dev) -> None:
    def beats() -> dict[str, datetime]:
        rows = dev.ask("runs list", task=["ops.beat"], limit=200)["data"]
        return {row["id"]: datetime.fromisoformat(row["run_at"]) for row in rows}

    before = beats()
    # The one-second schedule is due again a second after its last occurrence (materialized by the dev
    # process's startup tick); the dev process itself does not tick again within the hour.
    if before:
        due = max(before.values()) + timedelta(seconds=1.05)
        time.sleep(max(0.0, min(2.0, (due - datetime.now(UTC)).total_seconds())))
    tick = wait_for(
        lambda: (result := dev.json("tick"))["tick"]["materialized"] and result,
        timeout=10,
        what="a tick that materializes the schedule",
    )["tick"]
    assert tick["materialized"] == 1
    assert set(tick) == {
        "materialized",
        "delivery_requested",
        "cancellations_finalized",
        "timeouts_finalized",
        "dispatch_reserved",
        "outbox_published",
        "outbox_failed",
        "outbox_dead_lettered",
    }
    (created,) = set(beats()) - set(before)
    run = dev.settled(created, "succeeded")  # and the dev worker executed it
    assert run["source"]["type"] == "schedule" and run["source"]["schedule_id"] == "ops.beat.every"

    limited = dev.json("tick", "--schedule-materialization-limit", "1", "--outbox-claim-limit", "1")
    assert 0 <= limited["tick"]["materialized"] <= 1

    human = dev.cli("tick")
    assert human.returncode == 0, human.stderr
    assert "tick complete" in human.stdout and "materialized" in human.stdout


def test_runs_attempts_lists_the_attempts_made_in_the_dev_process(dev: Dev) -> None:
    failed, _ = dev.failed_run()
    listed = dev.json("runs", "attempts", failed)
    assert listed["run_id"] == failed
    (attempt,) = listed["attempts"]
    assert attempt["attempt"] == 1 and attempt["status"] == "failed"
    assert attempt["failure"]["code"] == "task_failed"  # an unknown exception's text is never stored
    assert attempt["started_at"] and attempt["completed_at"]

    waiting = dev.trigger("ops.parked", {})  # never executed: no attempts
    assert dev.json("runs", "attempts", waiting) == {"run_id": waiting, "attempts": []}

    human = dev.cli("runs", "attempts", failed)
    assert human.returncode == 0 and human.stderr == ""
    header, row = human.stdout.splitlines()
    assert header.split() == ["attempt", "status", "started", "completed", "detail"]
    assert row.split()[:2] == ["1", "failed"] and row.endswith("task_failed: Task failed.")
    assert attempt["started_at"][:19] in row and attempt["completed_at"][:19] in row

    empty = dev.cli("runs", "attempts", waiting)
    assert empty.returncode == 0 and empty.stdout.strip() == f"{waiting} has no attempts yet"


def test_retry_creates_a_child_of_a_failed_run_that_the_dev_worker_executes(dev: Dev) -> None:
    failed, gate = dev.failed_run()
    gate.touch()  # the retried work now passes
    child = dev.json("retry", failed, "--actor-id", "ops-oncall")["run"]
    assert child["id"] != failed and child["task_id"] == "ops.gated" and child["status"] == "queued"
    assert child["source"]["type"] == "manual_retry" and child["source"]["source_run_id"] == failed
    done = dev.settled(child["id"], "succeeded")
    assert done["output"] == {"passed": True}
    assert dev.run(failed)["status"] == "failed"  # the source run is untouched
    linked = dev.json("runs", "list", "--source-run", failed)["data"]
    assert [row["id"] for row in linked] == [child["id"]]
    events = dev.ask("runs get", run_id=child["id"], events=True)["events"]["data"]
    created = events[0]["event"]
    assert created["type"] == "run.created" and created["actor"] == {"type": "operator", "id": "ops-oncall"}

    # Retrying a run that did not fail is refused inside the dev process, with the runtime's code.
    refused = dev.cli("--json", "retry", child["id"])
    error = json.loads(one_line_error(refused))["error"]
    assert error["code"] == "validation_failed" and "rerun" in error["message"]


def test_rerun_creates_a_child_of_a_succeeded_run(dev: Dev) -> None:
    source = dev.trigger("ops.echo", {"n": 7})
    dev.settled(source, "succeeded")
    child = dev.json("rerun", source, "--run-id", f"run_rerun_{uuid4().hex}")["run"]
    assert child["id"].startswith("run_rerun_") and child["payload"] == {"n": 7}
    assert child["source"]["type"] == "rerun" and child["source"]["source_run_id"] == source
    assert dev.settled(child["id"], "succeeded")["output"] == {"echo": 7}

    human = dev.cli("rerun", source)
    assert human.returncode == 0, human.stderr
    assert human.stdout.startswith("✓ created rerun run_") and f"rerun {source}" in human.stdout

    parked = dev.trigger("ops.parked", {})
    refused = dev.cli("rerun", parked)  # still queued: not terminal
    assert one_line_error(refused).startswith("error[validation_failed]: ")


def test_prune_deletes_old_terminal_runs_of_the_chosen_statuses(dev: Dev) -> None:
    succeeded = [dev.trigger("ops.echo", {"n": n}) for n in range(2)]
    for run_id in succeeded:
        dev.settled(run_id, "succeeded")
    cancelled = dev.trigger("ops.parked", {})
    assert dev.ask("cancel", run_id=cancelled)["run"]["status"] == "cancelled"
    failed, _ = dev.failed_run()

    scope = ("--older-than", "1ms", "--status", "succeeded", "--status", "cancelled")
    first = dev.json("prune", *scope, "--limit", "1", "--actor-id", "janitor")
    assert set(first) == {"pruned", "next_cursor"}
    assert isinstance(first["next_cursor"], str) and first["next_cursor"]  # more candidates remain
    rest = dev.json("prune", *scope, "--cursor", first["next_cursor"])  # the same scope, a default-size page
    assert set(rest) == {"pruned", "next_cursor"} and rest["next_cursor"] is None
    assert first["pruned"] + rest["pruned"] >= 3

    for run_id in [*succeeded, cancelled]:
        assert dev.refused("runs get", run_id=run_id)["code"] == "run_not_found"
    assert dev.run(failed)["status"] == "failed"  # not among the chosen statuses

    again = dev.json("prune", *scope)
    assert again == {"pruned": 0, "next_cursor": None}

    # A status filter that names an active status is a usage error: only terminal runs are pruned.
    active = dev.cli("--json", "prune", "--older-than", "1ms", "--status", "queued")
    assert active.returncode == 2 and "'queued' is not one of 'cancelled', 'failed', 'succeeded'" in active.stderr


def test_signal_send_resumes_a_run_waiting_in_the_dev_process(dev: Dev) -> None:
    key = f"approval_{uuid4().hex[:12]}"
    run_id = dev.trigger("ops.waiter", {"key": key})
    waiting = dev.settled(run_id, "released")
    assert waiting["wait"]["type"] == "signal" and waiting["wait"]["signal_key"] == key

    sent = dev.json("signal", "send", key)
    assert sent["signal_key"] == key and sent["resumed"] == [run_id]
    assert [run["id"] for run in sent["runs"]] == [run_id] and sent["runs"][0]["status"] == "queued"
    assert dev.settled(run_id, "succeeded")["output"] == {"resumed_on_attempt": 2}
    assert dev.json("signal", "send", key) == {"signal_key": key, "resumed": [], "runs": [], "more": False}

    other_key = f"approval_{uuid4().hex[:12]}"
    other = dev.trigger("ops.waiter", {"key": other_key})
    dev.settled(other, "released")
    human = dev.cli("signal", "send", other_key, "--limit", "5")
    assert human.returncode == 0 and human.stderr == ""
    assert human.stdout.splitlines() == [f"✓ signal {other_key} resumed 1 run", f"  {other}  ops.waiter  queued"]
    dev.settled(other, "succeeded")
    nothing = dev.cli("signal", "send", other_key)
    assert nothing.stdout.splitlines() == [f"✓ signal {other_key} resumed 0 runs"]

    bad = dev.cli("--json", "signal", "send", "bad:key")
    assert json.loads(one_line_error(bad))["error"]["code"] == "configuration_invalid"


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("runs", "attempts", "run_missing"), "run_not_found"),
        (("retry", "run_missing"), "run_not_found"),
        (("rerun", "run_missing"), "run_not_found"),
        (("runs", "attempts", "run:missing"), "validation_failed"),
    ],
    ids=["attempts", "retry", "rerun", "malformed-id"],
)
def test_a_bad_run_id_is_one_error_line_with_its_code(dev: Dev, args: tuple[str, ...], code: str) -> None:
    run_id = args[-1]
    human = dev.cli(*args)
    line = one_line_error(human)
    assert line.startswith(f"error[{code}]: ") and run_id in line

    as_json = dev.cli("--json", *args)
    error = json.loads(one_line_error(as_json))["error"]
    assert error["code"] == code and error["retryable"] is False
    if code == "run_not_found":
        assert error["meta"] == {"run_id": run_id, "environment": "default"}


def test_bridge_requests_without_the_right_token_change_nothing(dev: Dev) -> None:
    parked = dev.trigger("ops.parked", {})
    count = len(dev.ask("runs list", limit=200)["data"])
    refusal = {"error": {"code": "configuration_invalid", "message": "Missing or wrong dev bridge token."}}
    cancel = command("cancel", {"run_id": parked, "reason": "forged"})
    trigger = command("trigger", {"task_id": "ops.parked", "payload": {}})

    for token in (None, "", "not-the-token", dev.session.token[:-1], dev.session.token + "x"):
        for body in (cancel, trigger):
            status, answer = post(dev.session.port, body, token=token)
            assert status == 401, (token, answer)
            assert answer == refusal

    assert dev.run(parked)["status"] == "queued"
    assert len(dev.ask("runs list", limit=200)["data"]) == count
    assert read_session(dev.project.config) == dev.session  # refusals do not end or replace the session
    assert dev.process.poll() is None

    # The same request with the session's token is served: the refusal above was the token alone.
    status, answer = post(dev.session.port, cancel, token=dev.session.token)
    assert status == 200 and answer["stderr"] == ""
    assert json.loads(answer["stdout"])["run"]["status"] == "cancelled"
    assert dev.run(parked)["status"] == "cancelled"
