"""Core's run and run-event tables: keys and document codecs shared by core and operator projections.

Drivers never edit these documents; a driver with an operator read model decodes them (and hides
anything that does not decode as canonical) to keep its projection in the same commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..errors import ErrorCode, RunlaneError
from ..models import RunEventRecord, RunRecord
from .codecs import encode_storage_unsigned_integer
from .types import StorageDocument, StorageRecordKey

__all__ = [
    "RUNS_COLLECTION",
    "RUN_EVENTS_COLLECTION",
    "RUN_TOMBSTONES_COLLECTION",
    "RunChildCounts",
    "decode_run_document",
    "decode_run_event_document",
    "encode_run_document",
    "encode_run_event_document",
    "peek_run_document",
    "peek_run_event_document",
    "run_event_key",
    "run_key",
    "run_tombstone_key",
    "try_decode_run_document",
    "try_decode_run_event_document",
]

RUNS_COLLECTION = "runs"
RUN_EVENTS_COLLECTION = "run_events"
RUN_TOMBSTONES_COLLECTION = "run_tombstones"


def run_key(environment_key: str, run_id: str) -> StorageRecordKey:
    return StorageRecordKey(RUNS_COLLECTION, environment_key, run_id)


def run_event_key(environment_key: str, run_id: str, sequence: int) -> StorageRecordKey:
    return StorageRecordKey(RUN_EVENTS_COLLECTION, environment_key, run_id, encode_storage_unsigned_integer(sequence))


def run_tombstone_key(environment_key: str, run_id: str) -> StorageRecordKey:
    return StorageRecordKey(RUN_TOMBSTONES_COLLECTION, environment_key, run_id)


@dataclass(frozen=True, slots=True)
class RunChildCounts:
    """Exact child counts a visible run keeps so pruning never trusts an advisory index."""

    events: int = 0
    outbox: int = 0
    steps: int = 0
    links: int = 0

    def to_json(self) -> dict[str, int]:
        return {"events": self.events, "outbox": self.outbox, "steps": self.steps, "links": self.links}


def encode_run_document(run: RunRecord, children: RunChildCounts | None = None) -> StorageDocument:
    counts = children or RunChildCounts()
    document = StorageDocument.encode({"run": run.model_dump(mode="json"), "children": counts.to_json()})
    return remember_run_document(document, run, counts)


_RUN_CODEC = "run"


def _copy_json(value: Any) -> Any:
    if type(value) is dict:
        return {key: _copy_json(item) for key, item in value.items()}
    if type(value) is list:
        return [_copy_json(item) for item in value]
    return value


def _detached(run: RunRecord) -> RunRecord:
    """A copy sharing no mutable JSON (payload, output, meta, trace carrier, failure meta) with ``run``.

    Runs are frozen models, but their JSON fields are plain dicts and lists; a remembered run must
    never alias an object a caller holds, or a caller's mutation would leak into the next write.
    """
    values = run.__dict__
    update: dict[str, Any] = {}
    for name in ("payload", "output", "meta", "trace_carrier"):
        value = values[name]
        if type(value) is dict or type(value) is list:
            update[name] = _copy_json(value)
    failure = values["failure"]
    if failure is not None and failure.meta:
        update["failure"] = failure.model_copy(update={"meta": _copy_json(failure.meta)})
    if not update:
        return run
    if type(run) is not RunRecord or not _DIRECT_COPY:
        return run.model_copy(update=update)
    # ``run.model_copy(update=update)`` without its generic machinery: a shallow copy of the field
    # values with the copied JSON values swapped in, and the updated fields marked as set.
    copied = object.__new__(RunRecord)
    data = values.copy()
    data.update(update)
    fields_set = set(run.__pydantic_fields_set__)
    fields_set.update(update)
    _set(copied, "__dict__", data)
    _set(copied, "__pydantic_fields_set__", fields_set)
    _set(copied, "__pydantic_extra__", None)
    _set(copied, "__pydantic_private__", None)
    return copied


_set = object.__setattr__
# Valid while runs have no private attributes, no post-init hook and no extra fields.
_DIRECT_COPY = (
    not RunRecord.__private_attributes__
    and RunRecord.__pydantic_post_init__ is None
    and RunRecord.model_config.get("extra") != "allow"
)


def remember_run_document(document: StorageDocument, run: RunRecord, children: RunChildCounts) -> StorageDocument:
    """Remember the run a document was encoded from, so decoding it again skips parsing and validation."""
    return document.remember_decoded((_RUN_CODEC, _detached(run), children))


def _corrupt(what: str, error: Exception | None = None) -> RunlaneError:
    return RunlaneError(ErrorCode.INVARIANT_VIOLATION, f"A stored {what} document is not canonical.", cause=error)


def decode_run_document(document: StorageDocument) -> tuple[RunRecord, RunChildCounts]:
    """The run and child counts of a run document (a fresh, caller-owned run every time)."""
    remembered = document.decoded
    if remembered is not None and remembered[0] == _RUN_CODEC:
        return _detached(remembered[1]), remembered[2]
    value = document.value
    try:
        run = RunRecord.model_validate(value["run"])
        children = RunChildCounts(**value["children"])
    except (KeyError, TypeError, ValidationError) as error:
        raise _corrupt("run", error) from None
    remember_run_document(document, run, children)
    return run, children


def try_decode_run_document(document: StorageDocument) -> RunRecord | None:
    try:
        return decode_run_document(document)[0]
    except RunlaneError:
        return None


_UNDECODABLE = ("undecodable",)


def peek_run_document(document: StorageDocument) -> RunRecord | None:
    """The run of a run document, decoded at most once per document and *shared*: read-only use only
    (a driver's operator projection copies before handing it out). ``None`` when it does not decode."""
    remembered = document.decoded
    if remembered is None or remembered[0] != _RUN_CODEC:
        if remembered is _UNDECODABLE:
            return None
        try:
            decode_run_document(document)
        except RunlaneError:
            document.remember_decoded(_UNDECODABLE)
            return None
        remembered = document.decoded
    return remembered[1]


def encode_run_event_document(record: RunEventRecord) -> StorageDocument:
    return StorageDocument.encode(record.model_dump(mode="json"))


def decode_run_event_document(document: StorageDocument) -> RunEventRecord:
    value: Any = document.value
    try:
        return RunEventRecord.model_validate(value)
    except ValidationError as error:
        raise _corrupt("run event", error) from None


def try_decode_run_event_document(document: StorageDocument) -> RunEventRecord | None:
    try:
        return decode_run_event_document(document)
    except RunlaneError:
        return None


_EVENT_CODEC = "run_event"


def peek_run_event_document(document: StorageDocument) -> RunEventRecord | None:
    """Like ``peek_run_document`` for a run event document: decoded once, shared, read-only."""
    remembered = document.decoded
    if remembered is None or remembered[0] != _EVENT_CODEC:
        if remembered is _UNDECODABLE:
            return None
        event = try_decode_run_event_document(document)
        document.remember_decoded(_UNDECODABLE if event is None else (_EVENT_CODEC, event))
        return event
    return remembered[1]
