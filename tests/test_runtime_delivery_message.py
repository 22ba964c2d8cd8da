"""``execute_delivery`` with a malformed message: ``configuration_invalid`` with one line naming each bad
field and its rule, never quoting what the message held (a trace carrier may carry a credential)."""

from __future__ import annotations

import json

import pytest
from runtime_support import make_runtime

from runlane import ErrorCode, RunlaneError, RunStatus, task

TOKEN = "s3cr3t-token"


@task("echo")
async def echo(payload: dict) -> dict:
    return {"echo": payload}


async def test_a_malformed_delivery_message_names_each_field_and_rule_without_its_value() -> None:
    runtime, _ = make_runtime(echo)
    async with runtime:
        run = (await runtime.trigger(echo, {})).run
        good = {
            "environment": {"name": run.environment.name},
            "run_id": run.id,
            "queue": run.queue,
            "requested_at": run.created_at.isoformat(),
        }
        cases = [
            (
                {**good, "trace_carrier": {"authorization": [f"Bearer {TOKEN}"]}},
                "Malformed delivery message: message.trace_carrier.authorization: Input should be a valid string.",
            ),
            (
                {**good, "requested_at": f"{TOKEN}", "note": f"Bearer {TOKEN}"},
                "Malformed delivery message: message.requested_at: Input should be a valid datetime or date, "
                "invalid character in year; message.note: Extra inputs are not permitted.",
            ),
            (
                {"run_id": run.id, "environment": TOKEN},
                "Malformed delivery message: message.environment: Input should be a valid dictionary or instance "
                "of Environment; message.queue: Field required; message.requested_at: Field required.",
            ),
            (f"Bearer {TOKEN}", "Malformed delivery message: message: Input should be a valid dictionary or instance"),
        ]
        for message, says in cases:
            with pytest.raises(RunlaneError) as raised:
                await runtime.execute_delivery(message)  # type: ignore[arg-type]
            error = raised.value
            assert error.code is ErrorCode.CONFIGURATION_INVALID and not error.retryable
            assert error.message.startswith(says), error.message
            assert "\n" not in error.message and "input_value" not in error.message
            assert TOKEN not in error.message + json.dumps(error.meta) + repr(error) + str(error.to_json())
            assert error.meta == {"field": "message"}
        many = {**good, "trace_carrier": {f"h{number}": [TOKEN] for number in range(8)}}
        with pytest.raises(RunlaneError) as raised:
            await runtime.execute_delivery(many)
        assert raised.value.message.endswith("; and 3 more.") and TOKEN not in raised.value.message
        # The well-formed message is executed.
        assert (await runtime.execute_delivery(good)).run.status is RunStatus.SUCCEEDED
