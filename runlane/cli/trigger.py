"""``runlane trigger``: create one durable run through ``runlane.trigger()``.

Arguments are parsed (payload and ``--meta`` JSON) before the runtime is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..errors import ErrorCode, RunlaneError
from ..models import Actor
from ..vocabulary import ActorType
from .main import OperationParams, operation, run_operation
from .output import trigger_summary
from .options import (
    DURATION,
    ActorIdOption,
    QueueOption,
    RunIdOption,
    check_idempotency_key_ttl,
    checked,
    parse_iso_datetime,
    parse_json,
    read_json_text,
)

__all__ = ["app"]

app = typer.Typer()

_SEND_MATCHING = " Send a payload that matches the task's schema."

# An example payload of the JSON type the schema asked for, by the type of pydantic's error about the null.
_EXAMPLES = {
    **dict.fromkeys(("list_type", "tuple_type", "set_type", "frozen_set_type"), '["value"]'),
    "string_type": '"text"',
    **dict.fromkeys(("int_type", "float_type", "decimal_type"), "1"),
    "bool_type": "true",
}
_OBJECT_EXAMPLE = '{"key": "value"}'


def _example_payload(errors: Any) -> str:
    """An example of the payload the schema wants, from the validation errors of a null payload."""
    first = errors[0] if isinstance(errors, list) and len(errors) == 1 and isinstance(errors[0], dict) else {}
    return _OBJECT_EXAMPLE if first.get("loc") else _EXAMPLES.get(str(first.get("type")), _OBJECT_EXAMPLE)


class TriggerParams(OperationParams):
    task_id: str
    payload: Any = None
    queue: str | None = None
    run_id: str | None = None
    idempotency_key: str | None = None
    idempotency_key_ttl: str | None = None
    singleton_key: str | None = None
    concurrency_key: str | None = None
    meta: dict[str, Any] | None = None
    actor_id: str | None = None
    delay: str | None = None
    run_at: str | None = None


@operation(
    "trigger",
    TriggerParams,
    lambda output, params, result: output.trigger_result(result),
    summary=lambda params, result: trigger_summary(result),
    creates_runs=True,
)
async def _trigger(runtime: Any, params: TriggerParams) -> Any:
    try:
        return await _create(runtime, params)
    except RunlaneError as error:
        if params.payload is None and error.code is ErrorCode.VALIDATION_FAILED and "errors" in error.meta:
            # The usual cause: the payload argument was left out. Say so, with the shape of the fix.
            raise RunlaneError(
                error.code,
                f"{error.message.removesuffix(_SEND_MATCHING)} The payload was null: pass it as JSON after the task id, "
                f"as in: runlane trigger {params.task_id} '{_example_payload(error.meta['errors'])}'.",
                retryable=error.retryable,
                meta=error.meta,
            ) from None
        raise


async def _create(runtime: Any, params: TriggerParams) -> Any:
    return await runtime.trigger(
        params.task_id,
        params.payload,
        actor=Actor(type=ActorType.OPERATOR, id=params.actor_id),
        concurrency_key=params.concurrency_key,
        idempotency_key=params.idempotency_key,
        idempotency_key_ttl=params.idempotency_key_ttl,
        meta=params.meta,
        queue=params.queue,
        run_id=params.run_id,
        singleton_key=params.singleton_key,
        delay=params.delay,
        run_at=None if params.run_at is None else parse_iso_datetime(params.run_at, "--run-at"),
    )


@app.command("trigger", short_help="Create one durable run for TASK_ID, now or later.")
def trigger(
    ctx: typer.Context,
    task_id: Annotated[str, typer.Argument(help="Task id registered in the runtime.", metavar="TASK_ID")],
    payload_json: Annotated[
        str | None,
        typer.Argument(
            help="Payload as JSON (omit when the task takes none); - reads it from standard input, @FILE from a file.",
            metavar="[PAYLOAD_JSON]",
            callback=checked(parse_json, resolve=read_json_text),
        ),
    ] = None,
    queue: QueueOption = None,
    run_id: RunIdOption = None,
    idempotency_key: Annotated[
        str | None, typer.Option("--idempotency-key", help="Deduplicate producer retries.", metavar="K")
    ] = None,
    idempotency_key_ttl: Annotated[
        str | None,
        typer.Option(
            "--idempotency-key-ttl",
            help=(
                "How long a succeeded or cancelled run keeps its idempotency key (default: the task's, else 30d), "
                "or 'active': only until it finishes."
            ),
            metavar="D",
            callback=checked(check_idempotency_key_ttl),
        ),
    ] = None,
    singleton_key: Annotated[
        str | None, typer.Option("--singleton-key", help="Prevent overlapping active runs.", metavar="K")
    ] = None,
    concurrency_key: Annotated[
        str | None, typer.Option("--concurrency-key", help="Partition bounded queue capacity.", metavar="K")
    ] = None,
    meta: Annotated[
        str | None,
        typer.Option(
            "--meta",
            help="JSON object stored on the creation event (- or @FILE as for the payload).",
            metavar="JSON",
            callback=checked(lambda text, name: parse_json(text, name, require_object=True), resolve=read_json_text),
        ),
    ] = None,
    actor_id: ActorIdOption = None,
    delay: Annotated[
        str | None,
        typer.Option("--delay", help="Start no sooner than this duration from now.", metavar="D", callback=DURATION),
    ] = None,
    run_at: Annotated[
        str | None,
        typer.Option(
            "--run-at",
            help="Start no sooner than this time (ISO 8601; UTC unless it has an offset).",
            metavar="DATE",
            callback=checked(parse_iso_datetime),
        ),
    ] = None,
) -> None:
    """Create one durable run for TASK_ID (to start at once, or later with --delay or --run-at)."""
    if delay is not None and run_at is not None:
        ctx.fail("--delay and --run-at do not go together: give one of them.")
    payload: Any = parse_json(payload_json, "PAYLOAD_JSON")  # both checked by their callbacks already
    meta_value = parse_json(meta, "--meta", require_object=True)
    run_operation(
        ctx,
        "trigger",
        task_id=task_id,
        payload=payload,
        queue=queue,
        run_id=run_id,
        idempotency_key=idempotency_key,
        idempotency_key_ttl=idempotency_key_ttl,
        singleton_key=singleton_key,
        concurrency_key=concurrency_key,
        meta=meta_value,
        actor_id=actor_id,
        delay=delay,
        run_at=run_at,
    )
