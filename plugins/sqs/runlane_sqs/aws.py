"""Calling an SQS client from the event loop, and turning what it raises into ``RunlaneError``.

A client is a boto3 SQS client (``boto3.client("sqs")``), whose calls block and so run in a worker
thread, or any object with the same methods; methods defined ``async def`` (aiobotocore) are awaited
directly. Errors are classified by what the caller can do about them:

- a throttle (KMS's too), a queue holding the most in-flight messages it may, a 5xx answer, a network
  failure or credentials AWS refuses (expired, rotated, wrong) is ``retryable``: the provider may answer
  later, or once the credentials are mended;
- a queue that does not exist, missing credentials or region: ``configuration_invalid``;
- any other refusal (access denied, an invalid parameter): not retryable.

Raw provider text stays out of public messages; the provider's code, HTTP status and request id go
in ``meta``.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from runlane.errors import ErrorCode, RunlaneError

__all__ = [
    "call_sqs",
    "classify_provider_error",
    "client_error_details",
    "in_daemon_thread",
    "is_retryable_provider_code",
]

# Real SQS names an error by its query code (the x-amzn-query-error header), which botocore reports as the
# error's code: its KmsThrottled is KMS.ThrottlingException. Compatible servers may send the shape name only.
_RETRYABLE_CODES = frozenset(
    {
        "AWS.SimpleQueueService.RequestThrottled",
        "InternalError",
        "InternalFailure",
        "KMS.ThrottlingException",
        "KmsThrottled",
        "OverLimit",  # ReceiveMessage while the queue holds the most in-flight messages SQS allows
        "RequestThrottled",
        "RequestTimeout",
        "ServiceUnavailable",
        "Throttling",
        "ThrottlingException",
    }
)
_MISSING_QUEUE_CODES = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "NonExistentQueue", "QueueDoesNotExist"}
)
# botocore's failures to reach the endpoint at all; matched by class name so this module needs no botocore.
_CONNECTION_ERRORS = frozenset(
    {
        "ConnectionClosedError",
        "ConnectTimeoutError",
        "EndpointConnectionError",
        "HTTPClientError",
        "ProxyConnectionError",
        "ReadTimeoutError",
    }
)
_SETUP_ERRORS = frozenset({"NoCredentialsError", "NoRegionError", "PartialCredentialsError"})
# AWS refusing the credentials themselves, not what they are allowed to do.
_CREDENTIAL_CODES = frozenset(
    {
        "ExpiredToken",
        "ExpiredTokenException",
        "IncompleteSignature",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "MissingAuthenticationToken",
        "SignatureDoesNotMatch",
        "UnrecognizedClientException",
    }
)


def is_retryable_provider_code(code: str | None, status: int | None = None) -> bool:
    """Whether a provider error code (or HTTP status) means "try again later"."""
    return code in _RETRYABLE_CODES or (status is not None and (status >= 500 or status == 429))


async def call_sqs(client: Any, operation: str, /, *, detached: bool = False, **params: Any) -> Any:
    """``client.<operation>(**params)`` without blocking the event loop.

    A blocking client's call runs in the loop's executor; ``detached=True`` runs it in a daemon thread of
    its own instead, for a call the caller may stop waiting for (a startup check while SQS hangs): a
    call left behind in the executor would hold up the process's exit until botocore gives up.
    """
    method = getattr(client, operation, None)
    if not callable(method):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The SQS client {type(client).__name__} has no {operation}() method; pass boto3.client('sqs').",
            meta={"operation": operation},
        )
    if inspect.iscoroutinefunction(method):
        return await method(**params)
    if detached:
        result = await in_daemon_thread(lambda: method(**params), f"runlane-sqs-{operation}")
    else:
        result = await asyncio.to_thread(method, **params)
    if inspect.isawaitable(result):
        result = await result
    return result


def in_daemon_thread(
    work: Callable[[], Any], name: str, on_return: Callable[[], None] | None = None
) -> asyncio.Future[Any]:
    """``work()`` in a daemon thread of its own: a future of the running loop settled with its result or
    exception, which the caller may stop waiting for (cancel) without holding up the process's exit.
    ``on_return`` runs on the loop when ``work`` has returned, cancelled or not."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if on_return is not None:
            on_return()
        if future.done():  # the caller stopped waiting
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            result = work()
        except BaseException as raised:  # handed to the loop, where the caller classifies it
            error = raised
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop has closed: nobody waits for the answer

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def client_error_details(error: BaseException) -> tuple[str | None, int | None, str | None]:
    """``(code, http_status, request_id)`` of a botocore ``ClientError``; all ``None`` otherwise."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None, None, None
    details = response.get("Error") or {}
    metadata = response.get("ResponseMetadata") or {}
    code = details.get("Code") if isinstance(details, dict) else None
    status = metadata.get("HTTPStatusCode") if isinstance(metadata, dict) else None
    request_id = metadata.get("RequestId") if isinstance(metadata, dict) else None
    return (
        code if isinstance(code, str) else None,
        status if isinstance(status, int) else None,
        request_id if isinstance(request_id, str) else None,
    )


def _refusal_hint(code: str | None, queue_url: str | None) -> str:
    """What to check for a refusal: the FIFO deduplication setting only where it can be the cause."""
    if code in ("InvalidParameterValue", "MissingParameter") and (queue_url or "").endswith(".fifo"):
        return (
            "For a FIFO queue without content-based deduplication, bind it with deduplication='outbox' (or "
            "enable content-based deduplication on the queue)."
        )
    if code in _CREDENTIAL_CODES:
        return (
            "AWS refused this process's credentials themselves (wrong or expired): configure valid ones "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY with AWS_SESSION_TOKEN, a profile or a role)."
        )
    if code is not None and ("AccessDenied" in code or "Authorization" in code or code.endswith("Forbidden")):
        return "Grant this process's AWS identity the SQS permissions the operation needs."
    return "Check the queue's settings and this process's SQS permissions."


def classify_provider_error(
    error: BaseException,
    *,
    operation: str,
    queue_url: str | None = None,
    refused: ErrorCode = ErrorCode.TRANSPORT_PUBLISH_FAILED,
    unavailable: ErrorCode = ErrorCode.TRANSPORT_UNAVAILABLE,
) -> RunlaneError:
    """The ``RunlaneError`` for ``error`` raised by the SQS ``operation`` (on ``queue_url``)."""
    if isinstance(error, RunlaneError):
        return error
    kind = type(error).__name__
    where = f" on {queue_url}" if queue_url else ""
    meta: dict[str, Any] = {"operation": operation, "provider_error": kind}
    if queue_url is not None:
        meta["queue_url"] = queue_url
    code, status, request_id = client_error_details(error)
    if code is not None or status is not None:
        meta.update({"provider_code": code, "http_status": status, "request_id": request_id})
        meta = {key: value for key, value in meta.items() if value is not None}
        if code in _MISSING_QUEUE_CODES:
            return RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"SQS {operation}{where}: the queue does not exist. Check the queue URL or name of the binding "
                "(and the region and account it is resolved in).",
                meta=meta,
                cause=error,
            )
        if code in _CREDENTIAL_CODES:
            # Credentials that expired (a session token past its hour), were rotated or are wrong: an outage of
            # this process's access, which the operator mends without touching a run. Retried, not refused for
            # good: refused, every wakeup published meanwhile would be dead-lettered and its run left queued.
            return RunlaneError(
                unavailable,
                f"SQS {operation}{where} failed with {code}. {_refusal_hint(code, queue_url)} Until then it is tried "
                "again, and nothing is lost.",
                retryable=True,
                meta=meta,
                cause=error,
            )
        if is_retryable_provider_code(code, status):
            return RunlaneError(
                unavailable,
                f"SQS {operation}{where} failed with {code or f'HTTP {status}'}; the provider is throttling or "
                "unavailable.",
                retryable=True,
                meta=meta,
                cause=error,
            )
        return RunlaneError(
            refused,
            f"SQS refused {operation}{where} with {code or f'HTTP {status}'}. {_refusal_hint(code, queue_url)}",
            retryable=False,
            meta=meta,
            cause=error,
        )
    if kind in _SETUP_ERRORS:
        return RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"SQS {operation}{where}: the client has no {'region' if kind == 'NoRegionError' else 'credentials'}. "
            "Configure them the AWS way (AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or a "
            "role).",
            meta=meta,
            cause=error,
        )
    if kind in _CONNECTION_ERRORS or isinstance(error, (OSError, asyncio.TimeoutError)):
        return RunlaneError(
            unavailable,
            f"SQS {operation}{where}: the endpoint could not be reached ({kind}).",
            retryable=True,
            meta=meta,
            cause=error,
        )
    if any(base.__name__ == "BotoCoreError" for base in type(error).__mro__):
        return RunlaneError(
            unavailable,
            f"SQS {operation}{where} failed in the client ({kind}).",
            retryable=True,
            meta=meta,
            cause=error,
        )
    return RunlaneError(
        ErrorCode.INTERNAL_ERROR,
        f"SQS {operation}{where} raised {kind}: {error}",
        meta=meta,
        cause=error,
    )
