"""Options shared by several commands, defined once as ``Annotated`` types so every command spells them alike.

Also ``MultiValueCommand``, the command class that lets a repeatable option take several values after
one flag (``--status succeeded cancelled``), and the small parsers that turn option text into runtime
arguments (JSON objects, ISO dates, durations, ``--older-than``). The parsers raise
``configuration_invalid``; ``checked(parser)`` makes one an option callback, so a malformed value is a
usage error (exit 2) reported as Click reports any bad value, before any runtime is loaded. Nothing
here prints or touches the runtime.
"""

from __future__ import annotations

import io
import json
import math
import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import typer
from typer.core import TyperCommand, TyperOption

from ..core.authoring import parse_idempotency_key_ttl
from ..core.runtime import MAX_WORKER_CONCURRENCY
from ..defaults import contract_defaults
from ..durations import duration_ms, parse_duration
from ..errors import ErrorCode, RunlaneError
from ..json_values import MAX_JSON_DEPTH, nested_too_deeply

if TYPE_CHECKING:
    # The context Typer's commands are given: its vendored Click's, not ``typer.Context``.
    from typer._click.core import Context as ClickContext

__all__ = [
    "DURATION",
    "MULTI_VALUE",
    "PAGE_LIMIT_HELP",
    "ActorIdOption",
    "ConcurrencyOption",
    "CursorOption",
    "EmptyPollDelayOption",
    "HeartbeatIntervalOption",
    "LeaseDurationOption",
    "LimitOption",
    "MultiValueCommand",
    "QueueOption",
    "QueuesOption",
    "RunIdOption",
    "TickLimits",
    "WorkerIdOption",
    "check_duration",
    "check_idempotency_key_ttl",
    "checked",
    "parse_cutoff",
    "parse_iso_datetime",
    "parse_json",
    "read_json_text",
]

# -- options with several values -------------------------------------------------------------------

MULTI_VALUE = "takes one or more values"
"""How a repeatable option's help text says it takes several values (``MultiValueCommand``)."""


class MultiValueCommand(TyperCommand):
    """A command whose repeatable options (``list[...]`` options) take one or more values after one flag.

    ``--status succeeded cancelled`` means the same as ``--status succeeded --status cancelled``; both
    forms mix freely. After the flag's first value, the parser keeps taking the following tokens as
    further values until one looks like an option (``-x``, ``--name``) or is ``--``. That is only
    unambiguous for a command without positional arguments, so such a command cannot use this class.
    Pass it as ``@app.command(cls=MultiValueCommand)`` to every command with a repeatable option.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        arguments = [param.name for param in self.params if param.param_type_name == "argument"]
        if arguments:
            raise TypeError(
                f"{self.name}: options with several values would swallow the positional arguments {arguments}; "
                "use the plain command class"
            )

    def make_parser(self, ctx: ClickContext) -> Any:
        parser = super().make_parser(ctx)
        repeatable = {
            param
            for param in self.get_params(ctx)
            if param.param_type_name == "option"
            and getattr(param, "multiple", False)
            and not cast(TyperOption, param).is_flag
        }
        options = {**parser._long_opt, **parser._short_opt}  # Click's parser has no public per-option hook
        for option in options.values():
            if option.obj in repeatable and not getattr(option, "_takes_several", False):
                # Click's private parser option: its ``process`` is replaced, and marked so it is wrapped once.
                option.process = _taking_several(option.process)  # type: ignore[method-assign]
                option._takes_several = True  # type: ignore[attr-defined]
        return parser


def _taking_several(process: Any) -> Any:
    """``process`` for one value, then for each following token that is not an option or ``--``."""

    def process_all(value: Any, state: Any) -> None:
        process(value, state)
        while state.rargs and not _is_option_like(state.rargs[0]):
            process(state.rargs.pop(0), state)

    return process_all


def _is_option_like(token: str) -> bool:
    return token == "--" or (token.startswith("-") and len(token) > 1)


# -- values checked while the command line is parsed ---------------------------------------------


def checked(
    parse: Callable[[Any, str], object], *, resolve: Callable[[Any, Any, str], Any] | None = None
) -> Callable[[Any, Any, Any], Any]:
    """An option (or argument) callback: the value must pass ``parse(value, name)``.

    A ``RunlaneError`` from ``parse`` becomes Click's bad-parameter usage error (exit 2): ``Invalid value
    for '--older-than': '30x': use a number with a unit, ...``, in human and ``--json`` mode alike, as
    for an out-of-range ``--limit``. The value is passed on unchanged; the command parses it where it uses
    it (possibly in a ``runlane dev`` process). With ``resolve(ctx, value, name)`` the value is first
    replaced by what it names (``read_json_text``), and that is checked and passed on.
    """

    def callback(ctx: Any, param: Any, value: Any) -> Any:
        if value is None or ctx.resilient_parsing:
            return value
        name = param.opts[0] if param.param_type_name == "option" else str(param.name).upper()
        try:
            if resolve is not None:
                value = resolve(ctx, value, name)
            parse(value, name)
        except RunlaneError as error:
            problem = _about_the_value(error.message, name, value)
            raise typer.BadParameter(problem, ctx=ctx, param_hint=f"'{name}'") from None
        return value

    return callback


_STDIN_READ_BY = "runlane.stdin_read_by"
# The most a JSON argument read from standard input or a file may hold (characters, or bytes of a file).
_MAX_JSON_INPUT = 64 * 2**20


def read_json_text(ctx: Any, value: str, name: str) -> str:
    """The JSON text of an argument: the argument itself, standard input for ``-``, or the content of a
    UTF-8 file for ``@PATH`` (for a payload larger than a command line takes, or one a program writes)."""
    if value == "-":
        meta = ctx.find_root().meta
        if _STDIN_READ_BY in meta:
            other = meta[_STDIN_READ_BY]
            raise _invalid(f"{name} cannot read standard input: {other} does; pass one of them as @FILE.")
        meta[_STDIN_READ_BY] = name
        source, empty = "standard input", "pipe the JSON value into the command, or pass it as the argument itself"
        try:
            text = _stdin_text().read(_MAX_JSON_INPUT + 1)
        except (OSError, UnicodeDecodeError) as error:
            raise _invalid(f"{name} could not read standard input ({error}).", argument=name) from None
    elif value.startswith("@"):
        path = Path(value[1:]).expanduser()
        # Quoted as Python writes a string: a file name may hold a newline or a terminal escape sequence.
        source, empty = repr(str(path)), "the file is empty; write the JSON value to it"
        try:
            with path.open("rb") as file:  # not read whole: it may be a log of gigabytes, or /dev/zero
                data = file.read(_MAX_JSON_INPUT + 1)
            text = data.decode("utf-8-sig")  # a byte order mark some editors write is no JSON
        except UnicodeDecodeError:
            raise _invalid(f"{name} could not read {source}: it is not UTF-8 text.", argument=name) from None
        except (OSError, ValueError) as error:  # ValueError: a NUL in the name, one the locale cannot encode
            problem = error.strerror if isinstance(error, OSError) and error.strerror else error
            hint = ""
            if value == "@-" and isinstance(error, FileNotFoundError):  # curl's spelling of standard input
                hint = " To read standard input, pass - alone (without the @)."
            raise _invalid(f"{name} could not read {source} ({problem}).{hint}", argument=name) from None
    else:
        return value
    if len(text) > _MAX_JSON_INPUT:
        raise _invalid(
            f"{name} read more than {_MAX_JSON_INPUT // 2**20} MiB from {source}, far more than any run holds (a "
            "lane's records are 400 KiB at most by default); pass the JSON value itself.",
            argument=name,
        )
    if not text.strip():  # said here, where the source is known (``parse_json`` would call it an empty string)
        raise _invalid(f"{name} read nothing from {source}: {empty}.", argument=name)
    return text


def _stdin_text() -> Any:
    """Standard input as text: UTF-8 whatever the locale says, as JSON is."""
    stream = sys.stdin
    if stream is None:
        raise OSError("it is closed")
    buffer = getattr(stream, "buffer", None)
    return stream if buffer is None else io.TextIOWrapper(buffer, encoding="utf-8-sig", errors="strict")


def _about_the_value(message: str, name: str, value: Any) -> str:
    """A parser's message without the option name it starts with, which Click's ``for '--flag'`` names:
    ``Invalid --every '5x': use ...`` becomes ``'5x' is not valid: use ...``."""
    for prefix in (f"Invalid {name}: ", f"Invalid {name} ", f"{name} is ", f"{name} "):
        if message.startswith(prefix):
            message = message.removeprefix(prefix)
            break
    quoted = f"{value!r}: "
    if message.startswith(quoted):
        message = f"{value!r} is not valid: {message.removeprefix(quoted)}"
    return message


def check_duration(text: str, name: str) -> None:
    """A Runlane duration such as ``500ms``, ``30s`` or ``7d``."""
    duration_ms(text, name)


DURATION = checked(check_duration)
"""The callback of an option that takes a Runlane duration."""


# -- shared option types ---------------------------------------------------------------------------

QueueOption = Annotated[str | None, typer.Option("--queue", help="Override the queue.", metavar="Q")]
QueuesOption = Annotated[
    list[str] | None, typer.Option("--queue", help=f"Limit to this queue; {MULTI_VALUE}.", metavar="Q...")
]
RunIdOption = Annotated[str | None, typer.Option("--run-id", help="Supply the new run's id.", metavar="ID")]


def _check_actor_id(text: str, name: str) -> None:
    # An empty id (``--actor-id "$USER"`` with the variable unset) would be recorded as an anonymous operator.
    if not text.strip():
        raise _invalid(f"{name} must not be empty; omit it to record the default operator.", argument=name)


ActorIdOption = Annotated[
    str | None,
    typer.Option(
        "--actor-id", help="Operator actor id recorded on the event.", metavar="ID", callback=checked(_check_actor_id)
    ),
]
CursorOption = Annotated[str | None, typer.Option("--cursor", help="Continue a previous page.", metavar="C")]


def limit_option(help: str) -> Any:
    """A ``--limit N`` option (a whole number, at least 1) saying what it limits."""
    return typer.Option("--limit", min=1, help=help, metavar="N")


_PAGE = contract_defaults.pagination
PAGE_LIMIT_HELP = f"per page (default {_PAGE.default_limit}, at most {_PAGE.max_limit}; --cursor continues)."
LimitOption = Annotated[int | None, limit_option(f"Runs {PAGE_LIMIT_HELP}")]
ConcurrencyOption = Annotated[
    int, typer.Option("--concurrency", min=1, max=MAX_WORKER_CONCURRENCY, help="Worker slots.", metavar="N")
]


def max_runs_option(mode: str) -> Any:
    """A ``--max-runs N`` option, which applies only with the command's one-shot ``mode`` flag."""
    return typer.Option("--max-runs", min=1, help=f"With {mode}: stop after this many runs.", metavar="N")


EmptyPollDelayOption = Annotated[
    str | None,
    typer.Option(
        "--empty-poll-delay", help="Poll sleep when no work is due (default 100ms).", metavar="D", callback=DURATION
    ),
]
LeaseDurationOption = Annotated[
    str | None,
    typer.Option("--lease-duration", help="Override the run lease duration.", metavar="D", callback=DURATION),
]
HeartbeatIntervalOption = Annotated[
    str | None,
    typer.Option("--heartbeat-interval", help="Override the lease heartbeat interval.", metavar="D", callback=DURATION),
]


def check_lease_options(ctx: Any, lease_duration: str | None, heartbeat_interval: str | None) -> None:
    """Both flags given, a heartbeat that does not come before the lease runs out is a usage error (one
    flag alone is checked against the runtime's default by the runtime)."""
    if lease_duration is not None and heartbeat_interval is not None:
        if duration_ms(heartbeat_interval) >= duration_ms(lease_duration):
            ctx.fail(
                f"--heartbeat-interval {heartbeat_interval} must be shorter than --lease-duration {lease_duration}: "
                "a heartbeat extends the lease before it runs out."
            )
WorkerIdOption = Annotated[
    str | None, typer.Option("--worker-id", help="Worker identity recorded on leases (diagnostics).", metavar="ID")
]
HealthFileOption = Annotated[
    Path | None,
    typer.Option(
        "--health-file",
        help="Touch this file every 2 s while running (for liveness probes); removed on exit.",
        metavar="PATH",
        dir_okay=False,
    ),
]

ScheduleMaterializationLimit = Annotated[
    int | None,
    typer.Option("--schedule-materialization-limit", min=1, help="Bound schedule occurrences materialized.", metavar="N"),
]
DeliveryRequestLimit = Annotated[
    int | None, typer.Option("--delivery-request-limit", min=1, help="Bound delivery requests appended.", metavar="N")
]
CancellationFinalizationLimit = Annotated[
    int | None,
    typer.Option("--cancellation-finalization-limit", min=1, help="Bound cancellations finalized.", metavar="N"),
]
TimeoutFinalizationLimit = Annotated[
    int | None,
    typer.Option("--timeout-finalization-limit", min=1, help="Bound attempt timeouts finalized.", metavar="N"),
]
OutboxClaimLimit = Annotated[
    int | None, typer.Option("--outbox-claim-limit", min=1, help="Bound outbox rows claimed.", metavar="N")
]
DispatchReservationLimit = Annotated[
    int | None,
    typer.Option(
        "--dispatch-reservation-limit", min=1, help="Bound bounded-queue capacity reservations.", metavar="N"
    ),
]


class TickLimits(dict[str, int]):
    """The ``--<phase>-limit`` options given, as ``runlane.tick()`` keyword arguments (omitted ones left out)."""

    @classmethod
    def of(
        cls,
        schedule_materialization_limit: int | None,
        delivery_request_limit: int | None,
        cancellation_finalization_limit: int | None,
        timeout_finalization_limit: int | None,
        outbox_claim_limit: int | None,
        dispatch_reservation_limit: int | None = None,
    ) -> TickLimits:
        given = {
            "schedule_materialization_limit": schedule_materialization_limit,
            "delivery_request_limit": delivery_request_limit,
            "cancellation_finalization_limit": cancellation_finalization_limit,
            "timeout_finalization_limit": timeout_finalization_limit,
            "outbox_claim_limit": outbox_claim_limit,
            "dispatch_reservation_limit": dispatch_reservation_limit,
        }
        return cls({name: value for name, value in given.items() if value is not None})


# -- parsers ---------------------------------------------------------------------------------------


def _invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta)


class _NotFinite(Exception):
    """A ``NaN`` / ``Infinity`` token, or a number too large for a float: no JSON value."""


def _constant(name: str) -> Any:
    raise _NotFinite(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotFinite(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is too large")
    return value


def parse_json(text: str | None, what: str, *, require_object: bool = False) -> Any:
    """Parse an argument as strict JSON (no ``NaN`` or ``Infinity``); ``None`` stays ``None``."""
    if text is None:
        return None
    if not text.strip():
        raise _invalid(
            f"{what} is an empty string: JSON needs a value, for example '{{\"user_id\": \"user_123\"}}'.",
            argument=what,
        )
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_finite_float)
    except _NotFinite as error:
        raise _invalid(f"{what} is not valid JSON: {error} (JSON has no NaN or Infinity).", argument=what) from None
    except json.JSONDecodeError as error:
        raise _invalid(
            f"{what} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
            f"quote it for the shell, for example '{{\"user_id\": \"user_123\"}}'.",
            argument=what,
        ) from None
    except RecursionError:
        value = None
        nested = True
    except ValueError:  # a number of more than 4,300 digits, which Python refuses to convert
        raise _invalid(
            f"{what} has a number too long to read; JSON numbers here have at most 4,300 digits.", argument=what
        ) from None
    else:
        # The parser's own limit differs between Python releases (3.13 reads 3,000 levels): one rule for all.
        nested = nested_too_deeply(value)
    if nested:
        raise _invalid(
            f"{what} is nested too deeply to be read as JSON (at most {MAX_JSON_DEPTH} levels).", argument=what
        )
    if require_object and not isinstance(value, dict):
        raise _invalid(f"{what} must be a JSON object, such as '{{\"key\": \"value\"}}'.", argument=what)
    return value


# ISO 8601 only: a date (2026-05-01) or a date and time with optional fraction and offset.
_ISO = re.compile(r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)?)?", re.IGNORECASE)


def parse_iso_datetime(text: str, what: str, *, end_of_day: bool = False) -> datetime:
    """An ISO 8601 date or date-time; a value without an offset is UTC. Anything else (05/01/2026) is rejected.

    ``end_of_day``: the value is an inclusive upper bound, so a date alone means the last instant of that day
    (``--created-to 2026-05-01`` includes runs created during May 1st)."""
    candidate = text.strip()
    if not _ISO.fullmatch(candidate):
        raise _invalid(
            f"{what} {text!r} is not an ISO 8601 date or date-time; write it as 2026-05-01 or 2026-05-01T00:00:00Z.",
            argument=what,
        )
    try:
        value = datetime.fromisoformat(candidate.upper())  # RFC 3339 allows a lower-case t and z
        if end_of_day and len(candidate) == len("2026-05-01"):
            value = value.replace(hour=23, minute=59, second=59, microsecond=999999)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (ValueError, OverflowError) as error:  # OverflowError: year 1 or 9999 moved out of range by its offset
        reason = str(error).rstrip(".")
        if "offset must be a timedelta" in reason:  # Python's words for an offset of 24 hours or more
            reason = "its UTC offset must be less than 24 hours"
        raise _invalid(f"{what} {text!r} is not a valid date: {reason}.", argument=what) from None


# A number with or without a unit ('30x', '0s', '30 d'): a duration with something wrong in it.
_DURATION_LIKE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)\s*[a-z]*", re.IGNORECASE)


def check_idempotency_key_ttl(text: str, name: str) -> None:
    """``active`` or a Runlane duration."""
    parse_idempotency_key_ttl(text, name)


def older_than_option(example: str) -> Any:
    """The ``--older-than`` option of ``prune`` and ``observations trim``, checked while parsing."""
    return typer.Option(
        "--older-than",
        help=f"A duration ({example}) or ISO 8601 cutoff (UTC unless it has an offset).",
        metavar="DURATION_OR_ISO",
        callback=checked(lambda text, name: parse_cutoff(text)),
    )


def parse_cutoff(text: str) -> str | datetime:
    """``--older-than``: a Runlane duration (kept as text for the runtime) or an ISO 8601 cutoff."""
    candidate = text.strip()
    if _ISO.fullmatch(candidate):
        return parse_iso_datetime(candidate, "--older-than")
    try:
        duration = parse_duration(candidate, "--older-than")
    except RunlaneError:
        if _DURATION_LIKE.fullmatch(candidate):
            raise  # meant as a duration ('0s', '30 d'): its own message says what is wrong with it
        raise _invalid(
            f"--older-than {text!r} is neither a duration (30d, 12h) nor an ISO 8601 date or date-time "
            "(2026-05-01, 2026-05-01T00:00:00Z).",
            argument="--older-than",
        ) from None
    try:
        datetime.now(UTC) - duration
    except OverflowError:
        raise _invalid(
            f"--older-than {text!r} reaches before the year 1; give a shorter duration or a date.",
            argument="--older-than",
        ) from None
    return candidate
