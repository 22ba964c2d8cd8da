"""Schedule timing, occurrence identities, durable occurrence claims and the materializer
(``runlane.core.schedules``) over the in-memory driver with a controlled clock."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from runlane_local import local_storage_driver

from runlane.core.authoring import ScheduleDefinition, TaskDefinition, schedule, task
from runlane.core.schedules import (
    SCHEDULE_LATEST_OCCURRENCES_COLLECTION,
    SCHEDULE_OCCURRENCES_COLLECTION,
    ScheduleMaterializer,
    ScheduleOccurrences,
    latest_due_fire_time,
    next_fire_time,
    schedule_occurrence_id,
    scheduled_run_id,
    validate_cron,
)
from runlane.errors import (
    ErrorCode,
    RunlaneError,
    StorageConflictKind,
    create_storage_conflict_error,
    is_storage_conflict,
)
from runlane.ids import is_valid_id
from runlane.models import Environment, RunRecord, RunSource, ScheduleOccurrence
from runlane.storage import (
    NewStorageRecord,
    StorageDocument,
    StorageIndexName,
    StorageQuery,
    StorageRecordKey,
    encode_iso_date,
)
from runlane.testing import ControlledClock
from runlane.vocabulary import RunSourceType, RunStatus, ScheduleOccurrenceStatus, ScheduleType

ENV = Environment(name="test")
NEW_YORK = "America/New_York"
CLAIM_MS = 60_000


def at(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)


def ny(*parts: int, fold: int = 0) -> datetime:
    return datetime(*parts, tzinfo=ZoneInfo(NEW_YORK), fold=fold)


# ---------------------------------------------------------------------------------------------
# Timing: once


def test_once_is_due_at_and_after_run_at_and_not_before():
    definition = schedule("launch", run_at=at(2026, 3, 1, 12))
    assert definition.type is ScheduleType.ONCE
    assert latest_due_fire_time(definition, at(2026, 3, 1, 11, 59, 59)) is None
    assert latest_due_fire_time(definition, at(2026, 3, 1, 12)) == at(2026, 3, 1, 12)
    # A late materializer still uses the original run_at.
    assert latest_due_fire_time(definition, at(2027, 1, 1)) == at(2026, 3, 1, 12)


def test_once_run_at_in_another_zone_is_returned_in_utc():
    definition = schedule("launch", run_at=ny(2026, 3, 1, 7))
    fire = latest_due_fire_time(definition, at(2026, 3, 2))
    assert fire == at(2026, 3, 1, 12)
    assert fire.tzinfo is UTC


@pytest.mark.parametrize(
    ("expression", "zone", "minute"),
    [
        ("*/15 * * * *", None, at(2026, 3, 1, 12, 15)),
        ("30 1 * * *", NEW_YORK, at(2026, 11, 1, 5, 30)),  # 01:30 EST: the second pass of a repeated hour
        ("*/10 * * * *", NEW_YORK, at(2026, 11, 1, 5, 40)),  # the repeated hour fires at both passes
        ("30 2 * * *", NEW_YORK, at(2026, 3, 8, 7, 30)),  # 03:30 EDT: 02:30 was skipped that day
    ],
)
def test_every_instant_of_a_minute_has_the_fire_time_of_its_first_instant(expression, zone, minute):
    definition = schedule("minutely", cron=expression, time_zone=zone)
    expected = latest_due_fire_time(definition, minute)
    assert expected is not None and expected <= minute
    for offset in (timedelta(seconds=1), timedelta(seconds=30), timedelta(seconds=59, microseconds=999_999)):
        assert latest_due_fire_time(definition, minute + offset) == expected


# ---------------------------------------------------------------------------------------------
# Timing: interval


def test_interval_anchors_to_the_unix_epoch_without_starts_at():
    definition = schedule("sync", every="15m")
    assert latest_due_fire_time(definition, at(2026, 1, 1, 10, 7, 30)) == at(2026, 1, 1, 10, 0)
    assert latest_due_fire_time(definition, at(2026, 1, 1, 10, 15)) == at(2026, 1, 1, 10, 15)  # inclusive
    # 7h cadence does not divide a day: boundaries follow the epoch, not midnight.
    seven = schedule("odd", every="7h")
    fire = latest_due_fire_time(seven, at(2026, 1, 1, 12))
    assert fire is not None and (fire - at(1970, 1, 1)) % timedelta(hours=7) == timedelta(0)
    assert at(2026, 1, 1, 12) - timedelta(hours=7) < fire <= at(2026, 1, 1, 12)


def test_interval_anchors_to_starts_at_and_has_no_boundary_before_it():
    definition = schedule("sync", every="1h", starts_at=at(2026, 1, 1, 10, 5))
    assert latest_due_fire_time(definition, at(2026, 1, 1, 10, 4, 59)) is None
    assert latest_due_fire_time(definition, at(2026, 1, 1, 10, 5)) == at(2026, 1, 1, 10, 5)
    assert latest_due_fire_time(definition, at(2026, 1, 1, 12, 4)) == at(2026, 1, 1, 11, 5)
    assert latest_due_fire_time(definition, at(2026, 1, 1, 12, 5)) == at(2026, 1, 1, 12, 5)


def test_interval_ends_at_caps_the_latest_boundary():
    definition = schedule("sync", every="1h", starts_at=at(2026, 1, 1, 10), ends_at=at(2026, 1, 1, 12, 30))
    assert latest_due_fire_time(definition, at(2026, 1, 1, 11, 59)) == at(2026, 1, 1, 11)
    assert latest_due_fire_time(definition, at(2026, 1, 1, 12, 45)) == at(2026, 1, 1, 12)
    assert latest_due_fire_time(definition, at(2026, 6, 1)) == at(2026, 1, 1, 12)
    on_boundary = schedule("edge", every="1h", starts_at=at(2026, 1, 1, 10), ends_at=at(2026, 1, 1, 12))
    assert latest_due_fire_time(on_boundary, at(2026, 6, 1)) == at(2026, 1, 1, 12)
    epoch_anchored = schedule("epoch", every="1d", ends_at=at(2026, 1, 10, 6))
    assert latest_due_fire_time(epoch_anchored, at(2026, 2, 1)) == at(2026, 1, 10)


def test_interval_materializes_only_the_latest_boundary_not_a_backfill():
    definition = schedule("sync", every="1m")
    # Three days late: still exactly one (the latest) fire time.
    assert latest_due_fire_time(definition, at(2026, 1, 4, 0, 0, 30)) == at(2026, 1, 4)


# ---------------------------------------------------------------------------------------------
# Timing: cron


def test_cron_defaults_to_utc_and_includes_a_fire_time_equal_to_now():
    definition = schedule("digest", cron="0 9 * * *")
    assert latest_due_fire_time(definition, at(2026, 1, 5, 8, 59, 59)) == at(2026, 1, 4, 9)
    assert latest_due_fire_time(definition, at(2026, 1, 5, 9)) == at(2026, 1, 5, 9)
    assert latest_due_fire_time(definition, at(2026, 1, 5, 9, 0, 0, 1)) == at(2026, 1, 5, 9)


def test_cron_is_interpreted_in_its_time_zone():
    definition = schedule("digest", cron="0 9 * * *", time_zone=NEW_YORK)
    # January: EST (UTC-5), so 09:00 New York is 14:00 UTC.
    assert latest_due_fire_time(definition, at(2026, 1, 5, 13, 59)) == at(2026, 1, 4, 14)
    assert latest_due_fire_time(definition, at(2026, 1, 5, 14)) == at(2026, 1, 5, 14)
    # July: EDT (UTC-4).
    assert latest_due_fire_time(definition, at(2026, 7, 6, 13, 30)) == at(2026, 7, 6, 13)


def test_cron_weekday_and_step_fields():
    weekdays = schedule("weekdays", cron="30 8 * * MON-FRI")
    # 2026-01-03 is a Saturday, so the latest fire is Friday 2026-01-02.
    assert latest_due_fire_time(weekdays, at(2026, 1, 4, 12)) == at(2026, 1, 2, 8, 30)
    quarter = schedule("quarter", cron="*/15 * * * *")
    assert latest_due_fire_time(quarter, at(2026, 1, 1, 10, 44, 59)) == at(2026, 1, 1, 10, 30)
    assert latest_due_fire_time(schedule("daily", cron="@daily"), at(2026, 1, 1, 10)) == at(2026, 1, 1)


def test_cron_wall_time_skipped_by_spring_forward_does_not_fire_that_day():
    # 2026-03-08: New York clocks jump from 02:00 EST to 03:00 EDT (07:00 UTC); 02:30 never happens.
    definition = schedule("nightly", cron="30 2 * * *", time_zone=NEW_YORK)
    previous_day = ny(2026, 3, 7, 2, 30).astimezone(UTC)
    assert previous_day == at(2026, 3, 7, 7, 30)
    nows = (at(2026, 3, 8, 6, 59), at(2026, 3, 8, 7, 0), at(2026, 3, 8, 7, 30), at(2026, 3, 8, 8), at(2026, 3, 9, 6))
    for now in nows:
        assert latest_due_fire_time(definition, now) == previous_day, now
    # The next day 02:30 exists again, now in EDT (UTC-4).
    assert latest_due_fire_time(definition, at(2026, 3, 9, 6, 30)) == at(2026, 3, 9, 6, 30)
    # Around the gap, neighbouring wall times keep firing normally.
    before_gap = schedule("early", cron="30 1 * * *", time_zone=NEW_YORK)
    assert latest_due_fire_time(before_gap, at(2026, 3, 8, 12)) == at(2026, 3, 8, 6, 30)
    after_gap = schedule("late", cron="0 3 * * *", time_zone=NEW_YORK)
    assert latest_due_fire_time(after_gap, at(2026, 3, 8, 12)) == at(2026, 3, 8, 7)


def test_cron_wall_time_repeated_by_fall_back_fires_once_at_its_first_occurrence():
    # 2026-11-01: New York clocks fall back from 02:00 EDT to 01:00 EST (06:00 UTC); 01:30 happens twice.
    definition = schedule("nightly", cron="30 1 * * *", time_zone=NEW_YORK)
    first = ny(2026, 11, 1, 1, 30, fold=0).astimezone(UTC)
    second = ny(2026, 11, 1, 1, 30, fold=1).astimezone(UTC)
    assert (first, second) == (at(2026, 11, 1, 5, 30), at(2026, 11, 1, 6, 30))
    assert latest_due_fire_time(definition, at(2026, 11, 1, 5, 29)) == at(2026, 10, 31, 5, 30)
    for now in (first, at(2026, 11, 1, 6), second, at(2026, 11, 1, 6, 45), at(2026, 11, 1, 23)):
        assert latest_due_fire_time(definition, now) == first, now
    # The next day 01:30 is EST (UTC-5).
    assert latest_due_fire_time(definition, at(2026, 11, 2, 6, 30)) == at(2026, 11, 2, 6, 30)


def test_cron_during_the_repeated_hour_sees_first_pass_times_already_past():
    # At 01:15 EST (second pass) the first-pass 01:50 EDT has already happened.
    definition = schedule("late", cron="50 1 * * *", time_zone=NEW_YORK)
    assert latest_due_fire_time(definition, ny(2026, 11, 1, 1, 15, fold=1)) == at(2026, 11, 1, 5, 50)


def test_a_wildcard_cron_fires_through_the_repeated_hour_at_both_passes():
    # Like cron: a job whose minute or hour field is a wildcard does not pause while the clocks repeat.
    hourly = schedule("hourly", cron="0 * * * *", time_zone=NEW_YORK)
    assert latest_due_fire_time(hourly, at(2026, 11, 1, 5, 30)) == at(2026, 11, 1, 5)  # 01:00 EDT
    assert latest_due_fire_time(hourly, at(2026, 11, 1, 6, 30)) == at(2026, 11, 1, 6)  # 01:00 EST, again
    assert latest_due_fire_time(hourly, at(2026, 11, 1, 7)) == at(2026, 11, 1, 7)  # 02:00 EST
    assert latest_due_fire_time(schedule("macro", cron="@hourly", time_zone=NEW_YORK), at(2026, 11, 1, 6, 30)) == (
        at(2026, 11, 1, 6)
    )
    quarterly = schedule("quarterly", cron="*/15 * * * *", time_zone=NEW_YORK)
    fired = {latest_due_fire_time(quarterly, at(2026, 11, 1, 4) + timedelta(minutes=5 * step)) for step in range(48)}
    assert sorted(fired) == [at(2026, 11, 1, 4) + timedelta(minutes=15 * step) for step in range(16)]  # no gap
    # On a second-pass minute the first pass's later minutes are already past.
    assert latest_due_fire_time(quarterly, ny(2026, 11, 1, 1, 20, fold=1)) == at(2026, 11, 1, 6, 15)
    # Fixed times still fire once (above), and spring forward still skips what never happened.
    assert latest_due_fire_time(hourly, at(2026, 3, 8, 7, 30)) == at(2026, 3, 8, 7)  # 03:00 EDT follows 01:00 EST


@pytest.mark.parametrize(
    ("zone", "transition"),
    [
        ("America/New_York", at(2026, 11, 1, 6)),  # 02:00 EDT -> 01:00 EST
        ("Europe/London", at(2026, 10, 25, 1)),  # 02:00 BST -> 01:00 GMT
        ("Australia/Lord_Howe", at(2026, 4, 4, 15)),  # 02:00 +11 -> 01:30 +10:30, a half-hour repeat
    ],
)
@pytest.mark.parametrize("expression", ["30 * * * *", "*/15 * * * *", "0 * * * *", "45 1 * * *", "10,40 1-2 * * *"])
def test_cron_fire_times_across_a_fall_back_match_a_minute_by_minute_reference(
    zone: str, transition: datetime, expression: str
) -> None:
    """Every minute from 2h before to 2h after a fall-back, the latest fire time is the latest instant
    whose wall time matches: at both passes of a repeated wall time for a cron with a wildcard minute or
    hour field, only at the first pass for one at fixed times."""
    import bisect

    from croniter import croniter

    tz = ZoneInfo(zone)
    minute, hour = expression.split()[:2]
    both_passes = minute.startswith("*") or hour.startswith("*")
    fires = []
    instant = transition - timedelta(hours=30)
    while instant <= transition + timedelta(hours=2):
        local = instant.astimezone(tz)
        if croniter.match(expression, local.replace(tzinfo=None)) and (both_passes or not local.fold):
            fires.append(instant)
        instant += timedelta(minutes=1)
    definition = schedule("dst", cron=expression, time_zone=zone)
    now = transition - timedelta(hours=2)
    while now <= transition + timedelta(hours=2):
        expected = fires[bisect.bisect_right(fires, now) - 1]
        assert latest_due_fire_time(definition, now) == expected, now.astimezone(tz)
        now += timedelta(minutes=1)


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "expression",
    [
        "61 * * * *",
        "0 25 * * *",
        "foo",
        "0 9 * * * *",
        "0 9 * * * * 2026",
        "R 9 * * *",
        "H 9 * * *",
        "0 0 30 2 *",
        "@reboot",
        "",
        "   ",
    ],
)
def test_validate_cron_rejects_bad_expressions_with_configuration_invalid(expression: str):
    with pytest.raises(RunlaneError) as caught:
        validate_cron(expression)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta.get("field") == "cron"


@pytest.mark.parametrize(
    "expression", ["0 0 1 1 MON#1", "0 0 1-7 * MON#1", "0 0 15 * MON#1", "0 0 L * 0#1", "0 0 */2 * MON#1"]
)
def test_a_day_of_month_with_an_nth_weekday_is_refused_at_definition_not_fired_on_the_wrong_days(expression: str):
    # Cron fires on a day matching either day field; croniter skips days of the month for such a pair
    # ("0 0 1 1 MON#1" would not fire on 1 January 2027) or finds no date at all ("0 0 15 * MON#1").
    with pytest.raises(RunlaneError) as caught:
        schedule("monthly", cron=expression)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta == {"field": "cron", "schedule_id": "monthly"}
    assert "nth weekday" in caught.value.message and "second schedule" in caught.value.message
    assert schedule("monthly", cron="0 0 ? * MON#1").cron == "0 0 ? * MON#1"
    assert next_fire_time(schedule("first.monday", cron="0 0 * * MON#1"), at(2026, 12, 1)) == at(2026, 12, 7)


def test_a_cron_search_that_runs_off_the_calendar_finds_no_fire_time():
    # croniter raises ValueError past the year 9999 (or before the year 1) instead of its own error.
    assert next_fire_time(schedule("yearly", cron="0 0 1 1 *"), at(9999, 6, 1)) is None
    assert latest_due_fire_time(schedule("new.year", cron="0 0 31 12 *"), at(1, 6, 1)) is None
    berlin_gap = schedule("clocks.change", cron="30 2 * 3 SUN#5", time_zone="Europe/Berlin")
    assert next_fire_time(berlin_gap, at(2026, 12, 3)) is None


def test_validate_cron_accepts_and_normalizes_standard_expressions():
    assert validate_cron("0  9 * * *") == "0 9 * * *"
    assert validate_cron("30 8 * * MON-FRI") == "30 8 * * MON-FRI"
    assert validate_cron("0 9 1 MAR THU") == "0 9 1 MAR THU"  # names containing R or H are fine
    assert validate_cron("0 0 29 2 *") == "0 0 29 2 *"  # leap days are real dates
    assert validate_cron("@Daily") == "@daily"
    with pytest.raises(RunlaneError, match="five"):
        validate_cron("0 9 * * * *")


def test_bad_cron_fails_at_definition_and_when_a_built_definition_is_timed():
    with pytest.raises(RunlaneError) as caught:
        schedule("broken", cron="0 9 * *")
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "broken" in caught.value.message
    built = ScheduleDefinition(id="broken", type=ScheduleType.CRON, cron="0 9 * *")
    with pytest.raises(RunlaneError) as caught:
        latest_due_fire_time(built, at(2026, 1, 1))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_timing_many_schedules_of_one_cron_checks_the_expression_once(monkeypatch: pytest.MonkeyPatch):
    # Every tick times every schedule: thousands of schedules sharing an expression must not each
    # parse it again (a cache keyed by schedule would thrash once there are more schedules than it holds).
    from runlane.core import schedules as module

    parsed: list[str] = []
    real = module.croniter

    def counting(expression: str, *args: Any, **kwargs: Any) -> Any:
        parsed.append(expression)
        return real(expression, *args, **kwargs)

    monkeypatch.setattr(module, "croniter", counting)
    module._checked_cron.cache_clear()
    built = [ScheduleDefinition(id=f"feed{n}", type=ScheduleType.CRON, cron="7 9 * * *") for n in range(5000)]
    for _ in range(2):
        for definition in built:
            latest_due_fire_time(definition, at(2026, 1, 1, 10))
    assert parsed.count("7 9 * * *") <= 2  # checked once; fire times are searched per minute, not per schedule
    with pytest.raises(RunlaneError) as caught:  # the message still names the schedule
        latest_due_fire_time(ScheduleDefinition(id="feed_bad", type=ScheduleType.CRON, cron="7 9 * *"), at(2026, 1, 1))
    assert "feed_bad" in caught.value.message and caught.value.meta["schedule_id"] == "feed_bad"


def test_unknown_time_zone_is_rejected_by_authoring_and_by_the_timing_rules():
    with pytest.raises(RunlaneError) as caught:
        schedule("digest", cron="0 9 * * *", time_zone="Mars/Olympus_Mons")
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta.get("field") == "time_zone"
    built = ScheduleDefinition(id="digest", type=ScheduleType.CRON, cron="0 9 * * *", time_zone="Mars/Olympus_Mons")
    with pytest.raises(RunlaneError) as caught:
        latest_due_fire_time(built, at(2026, 1, 1))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


@pytest.mark.parametrize("zone", ["localtime", "posixrules", "posix/Europe/Paris", "right/UTC"])
def test_a_host_dependent_zone_file_is_not_a_time_zone(zone: str):
    """``localtime`` opens whatever this host is set to: hosts set differently would fire at other times."""
    with pytest.raises(RunlaneError) as caught:
        schedule("digest", cron="0 9 * * *", time_zone=zone)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta.get("field") == "time_zone"
    assert "not an IANA zone name" in caught.value.message


def test_ends_at_before_starts_at_is_rejected():
    with pytest.raises(RunlaneError) as caught:
        schedule("sync", every="1h", starts_at=at(2026, 1, 2), ends_at=at(2026, 1, 1))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    built = ScheduleDefinition(
        id="sync", type=ScheduleType.INTERVAL, every_ms=3_600_000, starts_at=at(2026, 1, 2), ends_at=at(2026, 1, 1)
    )
    with pytest.raises(RunlaneError) as caught:
        latest_due_fire_time(built, at(2026, 1, 3))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


@pytest.mark.parametrize(
    "run_at",
    [
        datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))),
        datetime.max.replace(tzinfo=timezone(timedelta(hours=-5))),
    ],
    ids=["before-year-1-in-utc", "after-year-9999-in-utc"],
)
def test_a_time_out_of_range_in_utc_is_configuration_invalid(run_at: datetime):
    with pytest.raises(RunlaneError) as caught:
        schedule("sync", run_at=run_at)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "is out of range in UTC (years 1 to 9999)" in caught.value.message


def test_an_interval_whose_next_boundary_is_past_the_year_9999_has_no_next_fire_time():
    huge = schedule("huge", every="3000000d")
    assert next_fire_time(huge, at(2026, 1, 1)) is None
    assert latest_due_fire_time(huge, at(2026, 1, 1)) == datetime(1970, 1, 1, tzinfo=UTC)


def test_naive_now_is_rejected():
    with pytest.raises(RunlaneError) as caught:
        latest_due_fire_time(schedule("sync", every="1h"), datetime(2026, 1, 1))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


# ---------------------------------------------------------------------------------------------
# Identities


def test_occurrence_ids_are_deterministic_opaque_and_scoped():
    fire = at(2026, 1, 1, 9)
    occurrence_id = schedule_occurrence_id(ENV, "digest", fire)
    assert occurrence_id == schedule_occurrence_id(ENV, "digest", fire)
    assert occurrence_id == schedule_occurrence_id(ENV, "digest", fire.astimezone(ZoneInfo(NEW_YORK)))  # same instant
    assert occurrence_id.startswith("occ_") and len(occurrence_id) == 4 + 32
    assert is_valid_id(occurrence_id) and "digest" not in occurrence_id
    others = {
        schedule_occurrence_id(Environment(name="other"), "digest", fire),
        schedule_occurrence_id(ENV, "digest2", fire),
        schedule_occurrence_id(ENV, "digest", fire + timedelta(microseconds=1)),
    }
    assert occurrence_id not in others and len(others) == 3


def test_scheduled_run_ids_derive_from_the_occurrence_id():
    occurrence_id = schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 9))
    run_id = scheduled_run_id(occurrence_id)
    assert run_id == scheduled_run_id(occurrence_id)
    assert run_id.startswith("run_sched_") and is_valid_id(run_id)
    assert run_id.removeprefix("run_sched_") != occurrence_id.removeprefix("occ_")
    assert run_id != scheduled_run_id(schedule_occurrence_id(ENV, "digest", at(2026, 1, 2, 9)))


# ---------------------------------------------------------------------------------------------
# The occurrence table


async def claim_digest(
    table: ScheduleOccurrences, fire: datetime, token: str, worker: str
) -> ScheduleOccurrence | None:
    return await table.claim(
        "digest", "digests.send", fire, claim_token=token, worker_id=worker, claim_duration_ms=CLAIM_MS
    )


async def claimed_index_rows(driver: Any) -> list[tuple[str, ...]]:
    result = await driver.query(StorageQuery(StorageIndexName.SCHEDULE_OCCURRENCES_CLAIMED, (ENV.name,)))
    return [item.sort for item in result.items]


async def test_claim_creates_a_claimed_occurrence_with_an_expiring_index_entry():
    clock = ControlledClock(at(2026, 1, 1, 9, 0, 5))
    driver = local_storage_driver(clock=clock)
    table = ScheduleOccurrences(driver, ENV)
    fire = at(2026, 1, 1, 9)

    occurrence = await claim_digest(table, fire, "tok-a", "w1")

    assert occurrence is not None
    assert occurrence.id == schedule_occurrence_id(ENV, "digest", fire)
    assert occurrence.status is ScheduleOccurrenceStatus.CLAIMED
    assert (occurrence.claim_token, occurrence.claimed_by) == ("tok-a", "w1")
    assert occurrence.claim_expires_at == clock.now() + timedelta(milliseconds=CLAIM_MS)
    assert occurrence.fire_at == fire and occurrence.run_ids == []
    assert await table.get(occurrence.id) == occurrence
    assert await table.get("occ_missing") is None
    assert await claimed_index_rows(driver) == [(encode_iso_date(occurrence.claim_expires_at), occurrence.id)]
    (record,) = await driver.get([StorageRecordKey(SCHEDULE_OCCURRENCES_COLLECTION, ENV.name, occurrence.id)])
    assert ScheduleOccurrence.model_validate(record.document.value) == occurrence


async def test_live_claim_blocks_other_claims_and_an_expired_claim_is_taken_over():
    clock = ControlledClock(at(2026, 1, 1, 9))
    driver = local_storage_driver(clock=clock)
    table = ScheduleOccurrences(driver, ENV)
    fire = at(2026, 1, 1, 9)
    first = await claim_digest(table, fire, "tok-a", "w1")
    assert first is not None

    clock.advance("59s")
    assert await claim_digest(table, fire, "tok-b", "w2") is None
    # The holder's own token is not a competing claim.
    assert await claim_digest(table, fire, "tok-a", "w1") == first

    clock.advance("1s")  # expiry is exclusive: a claim expiring now is no longer live
    taken = await claim_digest(table, fire, "tok-b", "w2")
    assert taken is not None and taken.id == first.id
    assert (taken.claim_token, taken.claimed_by) == ("tok-b", "w2")
    assert taken.claim_expires_at == clock.now() + timedelta(milliseconds=CLAIM_MS)
    assert taken.created_at == first.created_at and taken.updated_at == clock.now()
    assert await claimed_index_rows(driver) == [(encode_iso_date(taken.claim_expires_at), taken.id)]


async def test_complete_is_fenced_by_the_claim_token():
    clock = ControlledClock(at(2026, 1, 1, 9))
    driver = local_storage_driver(clock=clock)
    table = ScheduleOccurrences(driver, ENV)
    fire = at(2026, 1, 1, 9)
    first = await claim_digest(table, fire, "tok-a", "w1")
    assert first is not None
    clock.advance("2m")
    taken = await claim_digest(table, fire, "tok-b", "w2")
    assert taken is not None
    run_id = scheduled_run_id(first.id)

    with pytest.raises(RunlaneError) as stale:
        await table.complete(first.id, "tok-a", [run_id])
    assert is_storage_conflict(stale.value, StorageConflictKind.SCHEDULE_OCCURRENCE)
    with pytest.raises(RunlaneError) as missing:
        await table.complete("occ_missing", "tok-b", [run_id])
    assert is_storage_conflict(missing.value, StorageConflictKind.SCHEDULE_OCCURRENCE)

    clock.advance("1s")
    completed = await table.complete(first.id, "tok-b", [run_id])
    assert completed.status is ScheduleOccurrenceStatus.COMPLETED
    assert completed.run_ids == [run_id]
    assert completed.completed_at == clock.now() and completed.claim_expires_at is None
    assert await table.get(first.id) == completed
    assert await claimed_index_rows(driver) == []

    # A retried completion with the same token and runs is a no-op; anything else is a conflict.
    assert await table.complete(first.id, "tok-b", [run_id]) == completed
    with pytest.raises(RunlaneError) as other_runs:
        await table.complete(first.id, "tok-b", ["run_other"])
    assert is_storage_conflict(other_runs.value, StorageConflictKind.SCHEDULE_OCCURRENCE)
    with pytest.raises(RunlaneError) as after:
        await table.complete(first.id, "tok-a", [run_id])
    assert is_storage_conflict(after.value, StorageConflictKind.SCHEDULE_OCCURRENCE)

    # A completed occurrence is never claimed again, even long after.
    clock.advance("30d")
    assert await claim_digest(table, fire, "tok-c", "w3") is None


async def test_completing_a_later_occurrence_deletes_the_one_it_supersedes_and_earlier_ones_never_run_again():
    clock = ControlledClock(at(2026, 1, 1, 9, 30))
    driver = local_storage_driver(clock=clock)
    table = ScheduleOccurrences(driver, ENV)
    nine, ten, eleven = at(2026, 1, 1, 9), at(2026, 1, 1, 10), at(2026, 1, 1, 11)

    async def materialize(fire: datetime, token: str) -> ScheduleOccurrence:
        claimed = await claim_digest(table, fire, token, "w1")
        assert claimed is not None
        return await table.complete(claimed.id, token, [scheduled_run_id(claimed.id)])

    first = await materialize(nine, "tok-9")
    second = await materialize(ten, "tok-10")
    assert await table.get(first.id) is None
    assert await table.get(second.id) == second
    # A materializer whose clock is behind (or a changed definition) reaches 09:00 again: its record is
    # gone, but the schedule's latest completed fire time is later, so it is not claimed (its run may
    # have been pruned meanwhile: claiming it would create a second run for one fire time).
    assert await claim_digest(table, nine, "tok-9b", "w2") is None
    assert await claim_digest(table, ten, "tok-10b", "w2") is None  # the latest itself: completed
    assert await table.get(first.id) is None
    third = await materialize(eleven, "tok-11")
    assert await table.get(second.id) is None
    assert await table.get(third.id) == third


async def test_a_corrupt_latest_occurrence_record_is_reported_not_skipped():
    clock = ControlledClock(at(2026, 1, 1, 9, 30))
    driver = local_storage_driver(clock=clock)
    table = ScheduleOccurrences(driver, ENV)
    latest = StorageRecordKey(SCHEDULE_LATEST_OCCURRENCES_COLLECTION, ENV.name, "digest")

    async def corrupt(tx: Any) -> None:
        tx.create(NewStorageRecord(latest, StorageDocument.encode({"occurrence_id": "occ_x", "fire_at": "yesterday"})))

    await driver.with_transaction(corrupt)
    with pytest.raises(RunlaneError) as error:
        await claim_digest(table, at(2026, 1, 1, 9), "tok", "w1")
    assert error.value.code is ErrorCode.INVARIANT_VIOLATION
    assert "latest schedule occurrence" in error.value.message
    assert "Malformed storage date 'yesterday'. This is durable corruption" in error.value.message
    assert await table.get(schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 9))) is None  # nothing written


async def test_claim_rejects_bad_arguments():
    table = ScheduleOccurrences(local_storage_driver(clock=ControlledClock()), ENV)
    fire = at(2026, 1, 1)
    for kwargs in (
        {"claim_token": "", "worker_id": "w1", "claim_duration_ms": CLAIM_MS},
        {"claim_token": "t", "worker_id": "w:1", "claim_duration_ms": CLAIM_MS},
        {"claim_token": "t", "worker_id": "w1", "claim_duration_ms": 0},
    ):
        with pytest.raises(RunlaneError) as caught:
            await table.claim("digest", "digests.send", fire, **kwargs)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    with pytest.raises(RunlaneError):
        await claim_digest(table, datetime(2026, 1, 1), "t", "w1")


# ---------------------------------------------------------------------------------------------
# The materializer


MARKERS = "test_scheduled_runs"


class Crash(Exception):
    """Stands in for a process dying at a precise point."""


class FakeRuns:
    """Scheduled runs written as marker records through the driver, each in its own transaction.

    Creating a run id that already exists raises a storage conflict, like the core store does, so a
    duplicate materialization cannot go unnoticed.
    """

    def __init__(self, driver: Any, *, crash_after_create: bool = False) -> None:
        self.driver = driver
        self.calls: list[tuple[str, str, str, str]] = []
        self.crash_after_create = crash_after_create

    def _key(self, run_id: str) -> StorageRecordKey:
        return StorageRecordKey(MARKERS, ENV.name, run_id)

    async def create_run(
        self,
        definition: ScheduleDefinition,
        task_definition: TaskDefinition,
        occurrence: ScheduleOccurrence,
        run_id: str,
    ) -> RunRecord:
        self.calls.append((definition.id, task_definition.id, occurrence.id, run_id))
        await asyncio.sleep(0)
        payload = task_definition.dump_payload(task_definition.load_payload(definition.payload))

        async def body(tx: Any) -> RunRecord:
            (existing,) = await tx.get([self._key(run_id)])
            now = await tx.now()
            if existing is not None:
                raise create_storage_conflict_error(StorageConflictKind.EVENT_SEQUENCE, f"run {run_id} exists")
            run = RunRecord(
                id=run_id,
                environment=ENV,
                task_id=task_definition.id,
                queue="default",
                status=RunStatus.QUEUED,
                payload=payload,
                event_sequence=1,
                created_at=now,
                updated_at=now,
                source=RunSource(type=RunSourceType.SCHEDULE, schedule_id=definition.id, occurrence_id=occurrence.id),
            )
            tx.create(NewStorageRecord(self._key(run_id), StorageDocument.encode(run.model_dump(mode="json"))))
            return run

        run = await self.driver.with_transaction(body)
        if self.crash_after_create:
            raise Crash("process died after creating the run")
        return run

    async def get_run(self, run_id: str) -> RunRecord | None:
        (record,) = await self.driver.get([self._key(run_id)])
        return None if record is None else RunRecord.model_validate(record.document.value)

    async def count(self) -> int:
        return len(self.calls)


def make_task(task_id: str, *schedules: ScheduleDefinition) -> TaskDefinition:
    def handler() -> None:
        return None

    return task(task_id, schedule=list(schedules))(handler)


def make_payload_task(task_id: str, *schedules: ScheduleDefinition) -> TaskDefinition:
    def handler(payload: dict[str, int]) -> None:
        return None

    return task(task_id, schedule=list(schedules))(handler)


def pairs(*tasks: TaskDefinition) -> list[tuple[ScheduleDefinition, TaskDefinition]]:
    return [(item, definition) for definition in tasks for item in definition.schedules]


async def materialize(
    materializer: ScheduleMaterializer,
    runs: FakeRuns,
    schedules: Any,
    now: datetime,
    *,
    limit: int = 100,
    worker: str = "w1",
) -> int:
    return await materializer.materialize_due(
        schedules,
        now,
        limit=limit,
        create_run=runs.create_run,
        get_run=runs.get_run,
        worker_id=worker,
        claim_duration_ms=CLAIM_MS,
    )


async def test_materializes_every_schedule_kind_once_per_fire_time():
    clock = ControlledClock(at(2026, 1, 5, 9, 7))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    materializer = ScheduleMaterializer(driver, ENV)
    reports = make_payload_task(
        "reports.build",
        schedule("reports.daily", cron="0 9 * * *", payload={"n": 1}),
        schedule("reports.quarter", every="15m", payload={"n": 2}),
        schedule("reports.launch", run_at=at(2026, 1, 5, 8), payload={"n": 3}),
        schedule("reports.future", run_at=at(2026, 2, 1), payload={"n": 4}),
        schedule("reports.off", every="1m", payload={"n": 5}, enabled=False),
    )
    schedules = pairs(reports)

    assert await materialize(materializer, runs, schedules, clock.now()) == 3
    expected = {
        "reports.launch": at(2026, 1, 5, 8),
        "reports.daily": at(2026, 1, 5, 9),
        "reports.quarter": at(2026, 1, 5, 9),
    }
    assert [call[0] for call in runs.calls] == list(expected)  # one-off first, then registration order
    table = materializer.occurrences
    for schedule_id, fire in expected.items():
        occurrence_id = schedule_occurrence_id(ENV, schedule_id, fire)
        occurrence = await table.get(occurrence_id)
        assert occurrence is not None and occurrence.status is ScheduleOccurrenceStatus.COMPLETED
        assert occurrence.run_ids == [scheduled_run_id(occurrence_id)]
        assert (occurrence.task_id, occurrence.claimed_by) == ("reports.build", "w1")
        run = await runs.get_run(scheduled_run_id(occurrence_id))
        assert run is not None and run.source is not None and run.source.occurrence_id == occurrence_id

    # Nothing new is due: a second tick at the same time materializes nothing.
    assert await materialize(materializer, runs, schedules, clock.now()) == 0
    # Next quarter: only the interval schedule has a new fire time.
    clock.set(at(2026, 1, 5, 9, 15))
    assert await materialize(materializer, runs, schedules, clock.now()) == 1
    assert runs.calls[-1][0] == "reports.quarter"
    assert runs.calls[-1][2] == schedule_occurrence_id(ENV, "reports.quarter", at(2026, 1, 5, 9, 15))


async def test_a_late_tick_materializes_only_the_latest_due_occurrence():
    clock = ControlledClock(at(2026, 1, 1, 0, 0, 30))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    materializer = ScheduleMaterializer(driver, ENV)
    schedules = pairs(make_task("pings.send", schedule("pings", every="1m"), schedule("hourly", cron="0 * * * *")))
    assert await materialize(materializer, runs, schedules, clock.now()) == 2

    clock.set(at(2026, 1, 3, 17, 42, 10))  # days of missed boundaries
    assert await materialize(materializer, runs, schedules, clock.now()) == 2
    assert [call[2] for call in runs.calls[2:]] == [
        schedule_occurrence_id(ENV, "pings", at(2026, 1, 3, 17, 42)),
        schedule_occurrence_id(ENV, "hourly", at(2026, 1, 3, 17)),
    ]
    assert len(runs.calls) == 4


async def test_fall_back_day_materializes_the_repeated_wall_time_once():
    clock = ControlledClock(at(2026, 11, 1, 5, 30))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    materializer = ScheduleMaterializer(driver, ENV)
    schedules = pairs(make_task("nightly.run", schedule("nightly", cron="30 1 * * *", time_zone=NEW_YORK)))
    assert await materialize(materializer, runs, schedules, clock.now()) == 1
    clock.set(at(2026, 11, 1, 6, 30))  # 01:30 EST, the repeated wall time
    assert await materialize(materializer, runs, schedules, clock.now()) == 0
    clock.set(at(2026, 11, 2, 6, 30))
    assert await materialize(materializer, runs, schedules, clock.now()) == 1
    assert [call[2] for call in runs.calls] == [
        schedule_occurrence_id(ENV, "nightly", at(2026, 11, 1, 5, 30)),
        schedule_occurrence_id(ENV, "nightly", at(2026, 11, 2, 6, 30)),
    ]


async def test_limit_bounds_one_pass_and_the_rest_follow_on_the_next():
    clock = ControlledClock(at(2026, 1, 1, 12))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    materializer = ScheduleMaterializer(driver, ENV)
    schedules = pairs(make_task("work.run", *(schedule(f"s{index}", every="1h") for index in range(5))))
    assert await materialize(materializer, runs, schedules, clock.now(), limit=2) == 2
    assert await materialize(materializer, runs, schedules, clock.now(), limit=2) == 2
    assert await materialize(materializer, runs, schedules, clock.now(), limit=2) == 1
    assert await materialize(materializer, runs, schedules, clock.now(), limit=2) == 0
    assert [call[0] for call in runs.calls] == ["s0", "s1", "s2", "s3", "s4"]
    assert await materialize(materializer, runs, schedules, clock.now(), limit=0) == 0


async def test_two_materializers_racing_on_one_occurrence_create_exactly_one_run():
    clock = ControlledClock(at(2026, 1, 1, 9, 0, 1))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    schedules = pairs(make_task("digests.send", *(schedule(f"digest{index}", cron="0 9 * * *") for index in range(4))))
    first, second = ScheduleMaterializer(driver, ENV), ScheduleMaterializer(driver, ENV)

    counts = await asyncio.gather(
        materialize(first, runs, schedules, clock.now(), worker="w1"),
        materialize(second, runs, schedules, clock.now(), worker="w2"),
    )

    assert sum(counts) == 4
    occurrence_ids = [call[2] for call in runs.calls]
    expected = [schedule_occurrence_id(ENV, f"digest{index}", at(2026, 1, 1, 9)) for index in range(4)]
    assert sorted(occurrence_ids) == sorted(expected)
    for occurrence_id in occurrence_ids:
        occurrence = await first.occurrences.get(occurrence_id)
        assert occurrence is not None and occurrence.status is ScheduleOccurrenceStatus.COMPLETED
        assert occurrence.run_ids == [scheduled_run_id(occurrence_id)]


async def test_two_materializers_racing_on_a_single_schedule_many_times():
    for round_index in range(20):
        clock = ControlledClock(at(2026, 1, 1, 9) + timedelta(seconds=round_index))
        driver = local_storage_driver(clock=clock)
        runs = FakeRuns(driver)
        schedules = pairs(make_task("digests.send", schedule("digest", cron="0 9 * * *")))
        materializers = [ScheduleMaterializer(driver, ENV) for _ in range(3)]
        counts = await asyncio.gather(
            *(materialize(item, runs, schedules, clock.now(), worker=f"w{i}") for i, item in enumerate(materializers))
        )
        assert sorted(counts) == [0, 0, 1]
        assert len(runs.calls) == 1


async def test_crash_between_create_and_complete_is_recovered_after_claim_expiry():
    clock = ControlledClock(at(2026, 1, 1, 9, 0, 5))
    driver = local_storage_driver(clock=clock)
    schedules = pairs(make_payload_task("digests.send", schedule("digest", cron="0 9 * * *", payload={"user": 7})))
    occurrence_id = schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 9))
    run_id = scheduled_run_id(occurrence_id)

    crashing = FakeRuns(driver, crash_after_create=True)
    with pytest.raises(Crash):
        await materialize(ScheduleMaterializer(driver, ENV), crashing, schedules, clock.now(), worker="w1")
    assert len(crashing.calls) == 1
    stuck = await ScheduleOccurrences(driver, ENV).get(occurrence_id)
    assert stuck is not None and stuck.status is ScheduleOccurrenceStatus.CLAIMED and stuck.claimed_by == "w1"

    recovering = FakeRuns(driver)
    survivor = ScheduleMaterializer(driver, ENV)
    # While the dead process's claim is live, the occurrence is left alone.
    clock.advance("30s")
    assert await materialize(survivor, recovering, schedules, clock.now(), worker="w2") == 0
    # After expiry the survivor takes the claim, finds the run and completes without creating another.
    clock.advance("31s")
    assert await materialize(survivor, recovering, schedules, clock.now(), worker="w2") == 1
    assert recovering.calls == []
    completed = await survivor.occurrences.get(occurrence_id)
    assert completed is not None and completed.status is ScheduleOccurrenceStatus.COMPLETED
    assert completed.run_ids == [run_id] and completed.claimed_by == "w2"
    run = await recovering.get_run(run_id)
    assert run is not None and run.payload == {"user": 7}
    # The dead process's token can no longer complete the occurrence.
    with pytest.raises(RunlaneError) as stale:
        await survivor.occurrences.complete(occurrence_id, stuck.claim_token or "", [run_id])
    assert is_storage_conflict(stale.value, StorageConflictKind.SCHEDULE_OCCURRENCE)


async def test_a_claim_that_died_before_its_run_is_settled_without_a_run_once_a_later_fire_time_is_due():
    clock = ControlledClock(at(2026, 1, 1, 9, 0, 30))
    driver = local_storage_driver(clock=clock)
    digest = make_task("digests.send", schedule("digest", every="1m"))
    paused = make_task("reports.send", schedule("report", every="1m", enabled=False))
    table = ScheduleOccurrences(driver, ENV)
    nine, nine_one, nine_two = (schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 9, minute)) for minute in range(3))
    # Processes died holding claims: on 09:00 of the digest, on 09:00 of the paused report schedule, and,
    # with a clock two minutes ahead, on 09:02 of the digest. None of them created its run.
    dead = (("digest", at(2026, 1, 1, 9)), ("report", at(2026, 1, 1, 9)), ("digest", at(2026, 1, 1, 9, 2)))
    for schedule_id, fire_at in dead:
        assert await table.claim(
            schedule_id, "t", fire_at, claim_token=f"dead-{schedule_id}-{fire_at.minute}", worker_id="w0",
            claim_duration_ms=CLAIM_MS,
        )  # fmt: skip

    clock.advance("61s")  # 09:01:31: the claims on 09:00 expired, 09:01 is due
    runs = FakeRuns(driver)
    survivor = ScheduleMaterializer(driver, ENV)
    assert await materialize(survivor, runs, pairs(digest, paused), clock.now()) == 1
    assert [call[2] for call in runs.calls] == [nine_one]  # 09:00 is a missed fire time: no run
    assert await table.get(nine) is None  # completed behind the latest, so deleted
    assert await table.latest_fire_times(["digest"]) == [at(2026, 1, 1, 9, 1)]
    # The paused schedule's claim waits for it to be enabled again; 09:02 is not due on this clock.
    report = await table.get(schedule_occurrence_id(ENV, "report", at(2026, 1, 1, 9)))
    assert report is not None and report.status is ScheduleOccurrenceStatus.CLAIMED
    ahead = await table.get(nine_two)
    assert ahead is not None and ahead.status is ScheduleOccurrenceStatus.CLAIMED
    # Once 09:02 is due, the pass takes its expired claim over and creates its run.
    clock.advance("60s")
    assert await materialize(survivor, runs, pairs(digest, paused), clock.now()) == 1
    assert [call[2] for call in runs.calls] == [nine_one, nine_two]


async def test_a_fire_time_completed_after_a_later_one_leaves_no_occurrence_record_behind():
    # A pass whose clock is behind (or that straddles a fire time) claims 10:00; while it creates that
    # run, a pass whose clock is ahead materializes 10:01. 10:00 then completes behind the latest.
    clock = ControlledClock(at(2026, 1, 1, 10, 0, 59))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    schedules = pairs(make_task("digests.send", schedule("digest", every="1m")))
    behind, ahead = ScheduleMaterializer(driver, ENV), ScheduleMaterializer(driver, ENV)
    ten, ten_one = (schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 10, minute)) for minute in (0, 1))

    async def create_while_ahead_materializes(*args: Any) -> RunRecord:
        assert await materialize(ahead, runs, schedules, at(2026, 1, 1, 10, 1), worker="w2") == 1
        return await runs.create_run(*args)

    count = await behind.materialize_due(
        schedules,
        at(2026, 1, 1, 10, 0, 59),
        limit=10,
        create_run=create_while_ahead_materializes,
        get_run=runs.get_run,
        worker_id="w1",
        claim_duration_ms=CLAIM_MS,
    )

    assert count == 1 and sorted(call[2] for call in runs.calls) == sorted([ten, ten_one])
    # One record for the schedule, its latest: nothing would ever delete one for 10:00.
    assert await behind.occurrences.get(ten) is None
    latest = await behind.occurrences.get(ten_one)
    assert latest is not None and latest.status is ScheduleOccurrenceStatus.COMPLETED
    assert await behind.occurrences.latest_fire_times(["digest"]) == [at(2026, 1, 1, 10, 1)]
    # The high-water mark still keeps 10:00 from running again.
    assert await materialize(behind, runs, schedules, at(2026, 1, 1, 10, 0, 59), worker="w3") == 0
    assert len(runs.calls) == 2


async def test_a_run_created_concurrently_after_a_claim_takeover_is_reused():
    clock = ControlledClock(at(2026, 1, 1, 9))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    schedules = pairs(make_task("digests.send", schedule("digest", cron="0 9 * * *")))
    occurrence_id = schedule_occurrence_id(ENV, "digest", at(2026, 1, 1, 9))
    run_id = scheduled_run_id(occurrence_id)
    lookups: list[str] = []

    async def get_run_missing_once(requested: str) -> RunRecord | None:
        # The first lookup happens before the other process's run becomes visible.
        lookups.append(requested)
        return None if len(lookups) == 1 else await runs.get_run(requested)

    async def create_run_losing(definition: Any, task_definition: Any, occurrence: Any, requested: str) -> RunRecord:
        await runs.create_run(definition, task_definition, occurrence, requested)  # the other process wins
        return await runs.create_run(definition, task_definition, occurrence, requested)  # ours conflicts

    count = await ScheduleMaterializer(driver, ENV).materialize_due(
        schedules,
        clock.now(),
        limit=10,
        create_run=create_run_losing,
        get_run=get_run_missing_once,
        worker_id="w1",
        claim_duration_ms=CLAIM_MS,
    )
    assert count == 1 and lookups == [run_id, run_id]
    occurrence = await ScheduleOccurrences(driver, ENV).get(occurrence_id)
    assert occurrence is not None and occurrence.run_ids == [run_id]


async def test_a_failing_schedule_stops_the_pass_after_the_earlier_ones_materialized():
    clock = ControlledClock(at(2026, 1, 1, 12))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    materializer = ScheduleMaterializer(driver, ENV)
    good = make_payload_task("good.run", schedule("good", every="1h", payload={"n": 1}))
    valid = schedule("bad", every="1h", payload={"n": 2})
    bad_task = make_payload_task("bad.run", valid)
    # The schema no longer accepts the static payload (as after a deploy changed the schema).
    broken = dataclasses.replace(valid, payload={"n": "not a number"})
    later = make_payload_task("later.run", schedule("later", every="1h", payload={"n": 3}))
    schedules = [*pairs(good), (broken, bad_task), *pairs(later)]

    with pytest.raises(RunlaneError) as caught:
        await materialize(materializer, runs, schedules, clock.now())
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta.get("schedule_id") == "bad"
    assert [call[0] for call in runs.calls] == ["good"]  # the earlier one stays; the pass stopped at "bad"
    good_occurrence = await materializer.occurrences.get(schedule_occurrence_id(ENV, "good", at(2026, 1, 1, 12)))
    assert good_occurrence is not None and good_occurrence.status is ScheduleOccurrenceStatus.COMPLETED
    # Validation runs before the claim, so the bad schedule did not consume its occurrence.
    assert await materializer.occurrences.get(schedule_occurrence_id(ENV, "bad", at(2026, 1, 1, 12))) is None

    # Fixed: the next pass materializes it and the schedule after it.
    fixed = [*pairs(good), (valid, bad_task), *pairs(later)]
    assert await materialize(materializer, runs, fixed, clock.now()) == 2
    assert [call[0] for call in runs.calls] == ["good", "bad", "later"]

    # A bad cron fails the same way, naming its schedule.
    clock.advance("1h")
    cron_broken = ScheduleDefinition(id="cronbad", type=ScheduleType.CRON, cron="0 9 * *")
    with pytest.raises(RunlaneError) as cron_error:
        await materialize(materializer, runs, [(cron_broken, bad_task), *pairs(later)], clock.now())
    assert cron_error.value.code is ErrorCode.CONFIGURATION_INVALID
    assert cron_error.value.meta.get("schedule_id") == "cronbad"
    assert [call[0] for call in runs.calls] == ["good", "bad", "later"]


async def test_create_run_must_return_the_derived_run_id():
    clock = ControlledClock(at(2026, 1, 1, 12))
    driver = local_storage_driver(clock=clock)
    runs = FakeRuns(driver)
    schedules = pairs(make_task("work.run", schedule("work", every="1h")))

    async def wrong_id(definition: Any, task_definition: Any, occurrence: Any, run_id: str) -> RunRecord:
        return await runs.create_run(definition, task_definition, occurrence, "run_elsewhere")

    with pytest.raises(RunlaneError) as caught:
        await ScheduleMaterializer(driver, ENV).materialize_due(
            schedules,
            clock.now(),
            limit=10,
            create_run=wrong_id,
            get_run=runs.get_run,
            worker_id="w1",
            claim_duration_ms=CLAIM_MS,
        )
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION


def test_schedule_rejects_bad_cron_at_definition_time() -> None:
    from runlane import ErrorCode, RunlaneError, schedule

    with pytest.raises(RunlaneError) as caught:
        schedule("digest.broken", cron="61 * * * *")
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta.get("field") == "cron"
