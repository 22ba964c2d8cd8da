"""``runlane schedules``: the registered schedules with their next fire time (``next_fire_time``) and the
latest fire time materialized in the environment, through the CLI on a sqlite project and the dev bridge."""

from __future__ import annotations

import io
import itertools
import json
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from cli_support import Project, cli, make_project, running_dev, wait_for
from runlane_local import local_lane, local_storage_driver

from runlane import create_runlane, queue, schedule, task
from runlane.cli.output import Output
from runlane.core.schedules import (
    SCHEDULE_LATEST_OCCURRENCES_COLLECTION,
    ScheduleOccurrences,
    latest_due_fire_time,
    next_fire_time,
)
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import Environment, environment_key
from runlane.storage import NewStorageRecord, StorageDocument, StorageRecordKey, encode_iso_date
from runlane.testing import ControlledClock

PARIS = ZoneInfo("Europe/Paris")
EVERY_ANCHOR = datetime(2026, 1, 1, 0, 7, tzinfo=UTC)
EVERY = timedelta(minutes=15)

SCHEDULED_TASKS = """
from datetime import UTC, datetime

from runlane import queue, schedule, task

emails = queue("emails", default=True)
reports = queue("reports")


@task(
    "emails.digest",
    schedule=[
        schedule("digest.paris", cron="0 9 * * *", time_zone="Europe/Paris", payload={}),
        schedule(
            "digest.every", every="15m", starts_at=datetime(2026, 1, 1, 0, 7, tzinfo=UTC), queue=reports, payload={}
        ),
        schedule("digest.once", run_at=datetime(2020, 1, 1, tzinfo=UTC), payload={}),
        schedule("digest.off", cron="*/5 * * * *", enabled=False, payload={}),
    ],
)
def digest(payload: dict) -> None:
    return None
"""

UNSCHEDULED_TASKS = """
from runlane import queue, task

emails = queue("emails", default=True)


@task("emails.welcome")
def send_welcome(payload: dict) -> None:
    return None
"""


def at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def paris_nine_after(now: datetime) -> datetime:
    """The first 09:00 on Paris clocks after ``now`` (09:00 is never skipped or repeated there)."""
    today = now.astimezone(PARIS).date()
    days = (datetime.combine(today + timedelta(days=offset), time(9), PARIS) for offset in (-1, 0, 1, 2))
    return min(instant.astimezone(UTC) for instant in days if instant > now)


def paris_nine_before(now: datetime) -> datetime:
    """The latest 09:00 on Paris clocks at or before ``now``."""
    today = now.astimezone(PARIS).date()
    days = (datetime.combine(today + timedelta(days=offset), time(9), PARIS) for offset in (-2, -1, 0, 1))
    return max(instant.astimezone(UTC) for instant in days if instant <= now)


def every_after(now: datetime) -> datetime:
    return EVERY_ANCHOR + EVERY * ((now - EVERY_ANCHOR) // EVERY + 1)


def every_before(now: datetime) -> datetime:
    return EVERY_ANCHOR + EVERY * ((now - EVERY_ANCHOR) // EVERY)


def next_fires(now: datetime) -> tuple[str, str]:
    """The next fire times of ``digest.paris`` and ``digest.every`` after ``now``, as the CLI prints them."""
    return iso(paris_nine_after(now)), iso(every_after(now))


def latest_fires(now: datetime) -> tuple[str, str]:
    """The fire times of ``digest.paris`` and ``digest.every`` a tick at ``now`` materializes."""
    return iso(paris_nine_before(now)), iso(every_before(now))


def around(run: Callable[[], Any], expected: Callable[[datetime], Any]) -> tuple[Any, set[Any]]:
    """``run()`` and the values ``expected(now)`` takes for a ``now`` before or after it: a boundary may
    pass while the command runs."""
    before = datetime.now(UTC)
    result = run()
    after = datetime.now(UTC)
    return result, {expected(before), expected(after)}


def by_id(stdout: str) -> dict[str, dict[str, Any]]:
    document = json.loads(stdout)
    assert set(document) == {"data"}
    return {item["id"]: item for item in document["data"]}


# ---------------------------------------------------------------------------------------------
# next_fire_time


def test_next_fire_time_of_a_one_time_schedule_is_its_run_at_while_it_is_ahead() -> None:
    definition = schedule("once", run_at=at(2026, 3, 1, 12))
    assert next_fire_time(definition, at(2026, 3, 1, 11, 59, 59)) == at(2026, 3, 1, 12)
    assert next_fire_time(definition, at(2026, 3, 1, 12)) is None  # due now: not ahead any more
    assert next_fire_time(definition, at(2027, 1, 1)) is None


def test_next_fire_time_of_an_interval_is_anchored_and_bounded_as_materialization_is() -> None:
    anchored = schedule("every", every="15m", starts_at=at(2026, 1, 1, 10, 5), ends_at=at(2026, 1, 1, 11, 5))
    assert next_fire_time(anchored, at(2025, 12, 31)) == at(2026, 1, 1, 10, 5)  # starts_at itself fires
    assert next_fire_time(anchored, at(2026, 1, 1, 10, 5)) == at(2026, 1, 1, 10, 20)  # strictly after
    assert next_fire_time(anchored, at(2026, 1, 1, 10, 19, 59, 999_999)) == at(2026, 1, 1, 10, 20)
    assert next_fire_time(anchored, at(2026, 1, 1, 10, 50)) == at(2026, 1, 1, 11, 5)  # ends_at is inclusive
    assert next_fire_time(anchored, at(2026, 1, 1, 11, 5)) is None
    epoch_anchored = schedule("hourly", every="1h")
    assert next_fire_time(epoch_anchored, at(2026, 1, 1, 10, 0, 0, 1)) == at(2026, 1, 1, 11)
    odd = schedule("odd", every="7m")  # 7 minutes from the Unix epoch, not from the hour
    assert next_fire_time(odd, at(2026, 1, 1)) == latest_due_fire_time(odd, at(2026, 1, 1)) + timedelta(minutes=7)


def test_next_fire_time_of_a_cron_follows_its_time_zone_across_daylight_saving() -> None:
    paris = schedule("paris", cron="0 9 * * *", time_zone="Europe/Paris")
    assert next_fire_time(paris, at(2026, 3, 28, 7, 59, 59)) == at(2026, 3, 28, 8)  # 09:00 CET
    assert next_fire_time(paris, at(2026, 3, 28, 8)) == at(2026, 3, 29, 7)  # 09:00 CEST, 23 hours later
    new_york = ZoneInfo("America/New_York")
    # 02:30 never shows on the spring-forward day.
    gap = schedule("gap", cron="30 2 * * *", time_zone="America/New_York")
    assert next_fire_time(gap, at(2026, 3, 8, 5)) == datetime(2026, 3, 9, 2, 30, tzinfo=new_york).astimezone(UTC)
    # A fixed-time cron fires the repeated 01:30 once, at its first pass.
    fixed = schedule("fixed", cron="30 1 * * *", time_zone="America/New_York")
    first = datetime(2026, 11, 1, 1, 30, tzinfo=new_york).astimezone(UTC)
    assert next_fire_time(fixed, at(2026, 11, 1, 5)) == first
    assert next_fire_time(fixed, first) == datetime(2026, 11, 2, 1, 30, tzinfo=new_york).astimezone(UTC)
    # A wildcard-hour cron fires through the repeated hour at both passes: after 01:20 EDT, the next is
    # the second pass of 01:05 (EST), an hour before 02:05.
    hourly = schedule("hourly", cron="5 * * * *", time_zone="America/New_York")
    second_pass = datetime(2026, 11, 1, 1, 5, tzinfo=new_york, fold=1).astimezone(UTC)
    assert next_fire_time(hourly, datetime(2026, 11, 1, 1, 20, tzinfo=new_york).astimezone(UTC)) == second_pass


CRONS = ("30 1 * * *", "30 2 * * *", "0 9 * * *", "*/15 * * * *", "5 * * * *", "* 1 * * *", "45 0-3 * * *", "@hourly")
# (zone, a UTC instant a few hours before one of its transitions)
TRANSITIONS = (
    ("America/New_York", at(2026, 3, 8, 4)),  # spring forward at 02:00 EST
    ("America/New_York", at(2026, 11, 1, 3)),  # fall back at 02:00 EDT
    ("Europe/Paris", at(2026, 3, 28, 23)),  # spring forward at 02:00 CET
    ("Europe/Paris", at(2026, 10, 24, 22)),  # fall back at 03:00 CEST
    ("Australia/Lord_Howe", at(2026, 4, 4, 12)),  # back by half an hour at 02:00
    ("Australia/Lord_Howe", at(2026, 10, 3, 13)),  # forward by half an hour at 02:00
)


@pytest.mark.parametrize(("zone", "start"), TRANSITIONS, ids=lambda value: str(value))
def test_next_fire_time_is_the_fire_time_latest_due_fire_time_reaches_next(zone: str, start: datetime) -> None:
    # For T on both sides of the transition (odd seconds, not only whole minutes): N = next(T) is a fire
    # time (the latest due at N is N), nothing fires in between (the latest due just before N is at or
    # before T), and it is after what was due at T.
    for expression in CRONS:
        definition = schedule("s", cron=expression, time_zone=zone)
        for step in range(0, 6 * 3600, 7 * 60 + 13):
            now = start + timedelta(seconds=step)
            upcoming = next_fire_time(definition, now)
            assert upcoming is not None and upcoming > now, (expression, now)
            assert latest_due_fire_time(definition, upcoming) == upcoming, (expression, now, upcoming)
            just_before = latest_due_fire_time(definition, upcoming - timedelta(microseconds=1))
            assert just_before is None or just_before <= now, (expression, now, upcoming, just_before)
            due = latest_due_fire_time(definition, now)
            assert due is None or due < upcoming


def test_next_fire_time_of_an_interval_agrees_with_latest_due_fire_time() -> None:
    bounded = schedule("every", every="90s", starts_at=at(2026, 1, 1, 0, 0, 20), ends_at=at(2026, 1, 1, 1))
    for seconds in itertools.chain(range(-100, 3700, 37), (20, 110, 3590, 3600)):
        now = at(2026, 1, 1) + timedelta(seconds=seconds)
        upcoming = next_fire_time(bounded, now)
        if upcoming is None:
            assert latest_due_fire_time(bounded, at(2027, 1, 1)) == latest_due_fire_time(bounded, now)
            continue
        assert upcoming > now and latest_due_fire_time(bounded, upcoming) == upcoming
        just_before = latest_due_fire_time(bounded, upcoming - timedelta(microseconds=1))
        assert just_before is None or just_before <= now


# ---------------------------------------------------------------------------------------------
# The latest materialized fire time


async def test_latest_fire_times_reads_each_schedules_high_water_mark_and_reports_a_corrupt_one() -> None:
    environment = Environment(name="test")
    driver = local_storage_driver(clock=ControlledClock(at(2026, 1, 1, 9, 30)))
    table = ScheduleOccurrences(driver, environment)
    occurrence = await table.claim("digest", "emails.digest", at(2026, 1, 1, 9), claim_token="t", worker_id="w1",
                                   claim_duration_ms=60_000)  # fmt: skip
    assert occurrence is not None
    assert await table.latest_fire_times(["digest"]) == [None]  # claimed, not completed yet
    await table.complete(occurrence.id, "t", [])
    key = StorageRecordKey(SCHEDULE_LATEST_OCCURRENCES_COLLECTION, environment_key(environment), "broken")

    async def corrupt(tx: Any) -> None:
        tx.create(NewStorageRecord(key, StorageDocument.encode({"occurrence_id": "occ_x", "fire_at": "yesterday"})))

    await driver.with_transaction(corrupt)
    found = await table.latest_fire_times(["digest", "never", "broken"])
    assert found[:2] == [at(2026, 1, 1, 9), None]
    assert isinstance(found[2], RunlaneError) and found[2].code is ErrorCode.INVARIANT_VIOLATION
    assert "latest schedule occurrence" in found[2].message


async def test_a_corrupt_latest_record_shows_as_unreadable_with_a_warning() -> None:
    from runlane.cli.schedules import schedule_overview

    reports = queue("reports", default=True)

    @task("reports.daily", schedule=schedule("daily", cron="0 6 * * *", payload={}))
    def daily(payload: dict) -> None:
        return None

    runtime = create_runlane(lane=local_lane(), queues=[reports], tasks=[daily], clock=ControlledClock(at(2026, 1, 1)))
    key = StorageRecordKey(SCHEDULE_LATEST_OCCURRENCES_COLLECTION, environment_key(runtime.environment), "daily")

    async def corrupt(tx: Any) -> None:
        tx.create(NewStorageRecord(key, StorageDocument.encode({"fire_at": "2026-01-01T06:00:00.000Z"})))

    async with runtime:
        await runtime.lane.storage.with_transaction(corrupt)
        overview = await schedule_overview(runtime)
    stdout, stderr = io.StringIO(), io.StringIO()
    Output(stdout=stdout, stderr=stderr, width=200).schedules_table(overview)
    assert "unreadable" in stdout.getvalue() and "2026-01-01T06:00:00.000Z" in stdout.getvalue()  # the next fire
    assert "warning: the latest fire time of schedule 'daily'" in stderr.getvalue()
    stdout, stderr = io.StringIO(), io.StringIO()
    Output(json_mode=True, stdout=stdout, stderr=stderr).schedules_table(overview)
    (item,) = json.loads(stdout.getvalue())["data"]
    assert item["latest_fire_at"] is None and item["latest_fire_error"]["code"] == "invariant_violation"
    assert json.loads(stderr.getvalue())["warning"]["code"] == "invariant_violation"


async def test_the_next_fire_time_shown_comes_after_a_high_water_mark_ahead_of_the_clock() -> None:
    # A maintenance process whose clock is ahead materialized 09:00; this clock says 08:30. No fire time at
    # or before the mark is materialized again, so the next one is tomorrow's.
    from runlane.cli.schedules import schedule_overview

    reports = queue("reports", default=True)

    @task("reports.daily", schedule=schedule("daily", cron="0 9 * * *", payload={}))
    def daily(payload: dict) -> None:
        return None

    clock = ControlledClock(at(2026, 1, 1, 8, 30))
    runtime = create_runlane(lane=local_lane(), queues=[reports], tasks=[daily], clock=clock)
    key = StorageRecordKey(SCHEDULE_LATEST_OCCURRENCES_COLLECTION, environment_key(runtime.environment), "daily")
    latest = {"occurrence_id": "occ_x", "fire_at": encode_iso_date(at(2026, 1, 1, 9))}

    async def ahead(tx: Any) -> None:
        tx.create(NewStorageRecord(key, StorageDocument.encode(latest)))

    async with runtime:
        (item,) = await schedule_overview(runtime)
        assert item.next_fire_at == at(2026, 1, 1, 9)
        await runtime.lane.storage.with_transaction(ahead)
        (item,) = await schedule_overview(runtime)
    assert item.latest_fire_at == at(2026, 1, 1, 9) and item.next_fire_at == at(2026, 1, 2, 9)


async def test_a_fire_time_skipped_for_a_held_singleton_key_shows_as_skipped_not_as_a_run() -> None:
    # The high-water mark moves past a recurring fire time that met a singleton conflict, with no run: an
    # operator asking whether last night's report ran must not read that fire time as a run.
    from runlane.cli.schedules import schedule_overview

    reports = queue("reports", default=True)

    @task("reports.daily", singleton_key="reports.daily", schedule=schedule("daily", cron="0 9 * * *", payload={}))
    def daily(payload: dict) -> None:
        return None

    clock = ControlledClock(at(2026, 1, 1, 9, 30))
    runtime = create_runlane(lane=local_lane(), queues=[reports], tasks=[daily], clock=clock)
    async with runtime:
        holder = (await runtime.trigger(daily, {})).run  # holds the singleton key at 09:00
        assert (await runtime.tick()).materialized == 0
        (item,) = await schedule_overview(runtime)
        assert item.latest_fire_at == at(2026, 1, 1, 9)
        document = item.to_json()
        assert document["latest_fire_run_id"] is None and document["latest_fire_skipped"] is True
        stdout = io.StringIO()
        Output(stdout=stdout, stderr=io.StringIO(), width=200).schedules_table([item])
        assert "2026-01-01T09:00:00.000Z (skipped)" in stdout.getvalue()

        assert (await runtime.execute_next()).id == holder.id
        clock.advance("1d")
        assert (await runtime.tick()).materialized == 1
        (item,) = await schedule_overview(runtime)
        run = (await runtime.runs.list(task_ids=[daily])).data[0]
    document = item.to_json()
    assert document["latest_fire_at"] == "2026-01-02T09:00:00.000Z"
    assert document["latest_fire_run_id"] == run.id and document["latest_fire_skipped"] is False
    stdout = io.StringIO()
    Output(stdout=stdout, stderr=io.StringIO(), width=200).schedules_table([item])
    assert "(skipped)" not in stdout.getvalue()


# ---------------------------------------------------------------------------------------------
# Through the CLI


def test_schedules_shows_next_fire_times_and_after_a_tick_the_latest_materialized(tmp_path: Path) -> None:
    project = make_project(tmp_path, SCHEDULED_TASKS, lane="sqlite")
    result, expected = around(lambda: cli(project, "--json", "schedules"), next_fires)
    assert result.returncode == 0, result.stderr
    listed = by_id(result.stdout)
    assert list(listed) == ["digest.paris", "digest.every", "digest.once", "digest.off"]  # registration order
    assert (listed["digest.paris"]["next_fire_at"], listed["digest.every"]["next_fire_at"]) in expected
    paris = listed["digest.paris"]
    assert paris["task_id"] == "emails.digest" and paris["type"] == "cron" and paris["queue"] == "emails"
    assert paris["cron"] == "0 9 * * *" and paris["time_zone"] == "Europe/Paris" and paris["enabled"] is True
    assert paris["latest_fire_at"] is None and paris["latest_fire_error"] is None
    every = listed["digest.every"]
    assert every["type"] == "interval" and every["every_ms"] == 900_000 and every["queue"] == "reports"
    assert every["starts_at"] == "2026-01-01T00:07:00.000Z" and every["expression"].startswith("every 15m from ")
    once = listed["digest.once"]
    assert once["type"] == "once" and once["run_at"] == "2020-01-01T00:00:00.000Z"
    assert once["next_fire_at"] is None and once["latest_fire_at"] is None  # due, not materialized yet
    off = listed["digest.off"]
    assert off["enabled"] is False and off["next_fire_at"] is None and off["latest_fire_at"] is None
    assert off["time_zone"] == "UTC"  # a cron without one is read in UTC

    ticked, materialized = around(lambda: cli(project, "--json", "tick"), latest_fires)
    assert ticked.returncode == 0, ticked.stderr
    assert json.loads(ticked.stdout)["tick"]["materialized"] == 3  # each enabled schedule had a due fire time

    result, expected = around(lambda: cli(project, "--json", "schedules"), next_fires)
    assert result.returncode == 0, result.stderr
    listed = by_id(result.stdout)
    assert (listed["digest.paris"]["next_fire_at"], listed["digest.every"]["next_fire_at"]) in expected
    assert (listed["digest.paris"]["latest_fire_at"], listed["digest.every"]["latest_fire_at"]) in materialized
    assert listed["digest.once"]["latest_fire_at"] == "2020-01-01T00:00:00.000Z"
    assert listed["digest.once"]["next_fire_at"] is None
    assert listed["digest.off"]["latest_fire_at"] is None

    human = cli(project, "schedules")
    assert human.returncode == 0, human.stderr
    header, *lines = human.stdout.splitlines()
    assert header.split() == ["schedule", "task", "type", "expression", "queue", "enabled", "next", "fire", "latest",
                              "fire"]  # fmt: skip
    rows = {line.split()[0]: line for line in lines}
    assert list(rows) == ["digest.paris", "digest.every", "digest.once", "digest.off"]
    assert "0 9 * * * (Europe/Paris)" in rows["digest.paris"] and " yes " in rows["digest.paris"]
    assert rows["digest.once"].split()[-2:] == ["-", "2020-01-01T00:00:00.000Z"]
    assert rows["digest.off"].split()[-4:] == ["no", "-", "(disabled)", "-"]


def test_schedules_with_none_registered_says_so(tmp_path: Path) -> None:
    project = make_project(tmp_path, UNSCHEDULED_TASKS, lane="sqlite")
    human = cli(project, "schedules")
    assert human.returncode == 0, human.stderr
    assert human.stdout == "no schedules registered\n"
    machine = cli(project, "--json", "schedules")
    assert machine.returncode == 0, machine.stderr
    assert json.loads(machine.stdout) == {"data": []}


GAP_ONLY_TASKS = """
from runlane import queue, schedule, task

default = queue("default", default=True)


# The fifth Sunday of March is the last one, when Berlin's clocks skip from 02:00 to 03:00: since 1980
# this cron's wall time has never shown, and never will.
@task("clocks.change", schedule=schedule("clocks.change", cron="30 2 * 3 SUN#5", time_zone="Europe/Berlin"))
def clocks_change() -> None:
    return None
"""


def test_a_cron_whose_every_later_match_falls_in_a_daylight_saving_gap_has_no_next_fire_time(tmp_path: Path) -> None:
    project = make_project(tmp_path, GAP_ONLY_TASKS, lane="sqlite")
    machine = cli(project, "--json", "schedules")
    assert machine.returncode == 0, machine.stderr
    assert "Traceback" not in machine.stderr
    (listed,) = json.loads(machine.stdout)["data"]
    assert listed["id"] == "clocks.change" and listed["next_fire_at"] is None
    human = cli(project, "schedules")
    assert human.returncode == 0, human.stderr
    assert "clocks.change" in human.stdout


def test_schedules_reads_the_dev_process_lane_through_its_bridge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
    project = Project(make_project(tmp_path / "proj", SCHEDULED_TASKS), tmpdir)  # the process-local lane

    def materialized() -> dict[str, dict[str, Any]] | None:
        result = project.cli("--json", "schedules")
        assert result.returncode == 0, result.stderr
        assert "process_local_lane" not in result.stderr  # proxied, not run on an empty lane of its own
        listed = by_id(result.stdout)
        return listed if listed["digest.once"]["latest_fire_at"] else None

    with running_dev(project, "--tick-interval", "1h"):  # it ticks once as it starts
        listed = wait_for(materialized, what="the dev process's first tick")
    assert listed["digest.once"]["latest_fire_at"] == "2020-01-01T00:00:00.000Z"
    assert listed["digest.paris"]["latest_fire_at"] is not None
    assert listed["digest.off"]["latest_fire_at"] is None
