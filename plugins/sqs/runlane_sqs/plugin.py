"""runlane-sqs's plugin: the ``postgres-sqs`` lane, the ``sqs`` transport and ``runlane sqs consume``.

Loaded through the ``runlane`` entry-point group (``sqs = "runlane_sqs.plugin"``). In ``runlane.toml``::

    [lane]
    use = "postgres-sqs"

    [lane.postgres]
    connection_string = "${DATABASE_URL}"
    schema = "runlane"
    statement_timeout = "30s"               # optional, like connect_timeout ("10s") and pool_timeout ("30s")

    [lane.sqs]
    region = "${AWS_REGION:-us-east-1}"     # optional: else AWS_DEFAULT_REGION / the profile
    # endpoint_url = "http://localhost:4566" # an SQS-compatible server (LocalStack, ElasticMQ, moto)

    [lane.sqs.queues.default]               # one table per Runlane queue
    queue_url = "${RUNLANE_DEFAULT_QUEUE_URL}"

    [lane.sqs.queues.emails]
    queue_name = "runlane-emails.fifo"
    fifo = { message_group = "run", deduplication = "outbox" }

Credentials come from the AWS environment (variables, shared config, an instance or task role), as
for any boto3 client. Loading the plugin imports neither boto3 nor psycopg.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from runlane.cli.options import (
    HealthFileOption,
    HeartbeatIntervalOption,
    LeaseDurationOption,
    MultiValueCommand,
    QueuesOption,
    WorkerIdOption,
    check_lease_options,
)
from runlane.durations import duration_seconds
from runlane.errors import ErrorCode, RunlaneError
from runlane.plugins import hookimpl
from runlane.plugins.registries import LaneProvider, ProviderContext, TransportProvider
from runlane_postgres.plugin import PostgresStorageOptions

from .bindings import SQS_MAX_WAIT_TIME_SECONDS, SqsFifoDeduplication, SqsFifoMessageGroup, SqsFifoOptions, sqs_queue

if TYPE_CHECKING:
    from runlane.core.lanes import Lane

    from .transport import SqsTransport

__all__ = [
    "PostgresSqsLaneOptions",
    "SqsFifoTableOptions",
    "SqsQueueTableOptions",
    "SqsTransportOptions",
    "register_commands",
    "register_lanes",
    "register_transports",
    "sqs_cli",
]


def _blank_is_none(value: Any) -> Any:
    # ``${VAR:-}`` expands to "" when VAR is unset: treat it as "not configured".
    return None if value == "" else value


class SqsFifoTableOptions(BaseModel):
    """``fifo = { message_group = "run" | "queue", deduplication = "outbox" | "content_based" }``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    message_group: SqsFifoMessageGroup = SqsFifoMessageGroup.RUN
    deduplication: SqsFifoDeduplication = SqsFifoDeduplication.OUTBOX


class SqsQueueTableOptions(BaseModel):
    """``[lane.sqs.queues.<runlane queue>]``: exactly one of ``queue_url`` or ``queue_name``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_url: str | None = None
    queue_name: str | None = None
    queue_owner_aws_account_id: str | None = None
    fifo: SqsFifoTableOptions | None = None
    """``true`` for the defaults, or a table of FIFO options."""

    @field_validator("queue_url", "queue_name", "queue_owner_aws_account_id", mode="before")
    @classmethod
    def _blank(cls, value: Any) -> Any:
        return _blank_is_none(value)

    @field_validator("fifo", mode="before")
    @classmethod
    def _fifo_flag(cls, value: Any) -> Any:
        if value is True:
            return {}
        return None if value is False else value


class SqsTransportOptions(BaseModel):
    """``[lane.sqs]``: the SQS client (``region``, ``endpoint_url``, ``profile``, ``connect_timeout``,
    ``read_timeout``) and the queue bindings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    queues: dict[str, SqsQueueTableOptions] = Field(min_length=1)
    region: str | None = None
    endpoint_url: str | None = None
    profile: str | None = None
    # A wakeup publish waits at most about three times these (boto3 tries a call up to three times);
    # the read timeout must outlast the consumer's 20 s long poll.
    connect_timeout: float = Field(default="5s", validate_default=True)
    read_timeout: float = Field(default="30s", validate_default=True)
    batch_size: int = Field(default=10, ge=1, le=10)
    name: str = Field(default="sqs", min_length=1)

    @field_validator("region", "endpoint_url", "profile", mode="before")
    @classmethod
    def _blank(cls, value: Any) -> Any:
        return _blank_is_none(value)

    @field_validator("connect_timeout", "read_timeout", mode="before")
    @classmethod
    def _seconds(cls, value: object, info: Any) -> float:
        try:
            return duration_seconds(value, info.field_name)
        except RunlaneError as error:
            raise ValueError(error.message.rstrip(".")) from None

    @model_validator(mode="after")
    def _outlasts_the_long_poll(self) -> SqsTransportOptions:
        if self.read_timeout <= SQS_MAX_WAIT_TIME_SECONDS:
            raise ValueError(
                f"read_timeout must be longer than the {SQS_MAX_WAIT_TIME_SECONDS} s long poll of a consumer's "
                f"ReceiveMessage, got {self.read_timeout:g} s"
            )
        return self


class PostgresSqsLaneOptions(BaseModel):
    """``[lane] use = "postgres-sqs"``: a ``[lane.postgres]`` table (the ``postgres`` storage options, the
    Postgres keys of ``postgres-polling``; ``name`` names the storage driver) and a ``[lane.sqs]`` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    postgres: PostgresStorageOptions
    sqs: SqsTransportOptions
    name: str = Field(default="postgres-sqs", min_length=1)


# A URL's user information (``http://user:password@host``) and query (``?token=...``), as botocore quotes an
# endpoint_url (or AWS_ENDPOINT_URL_SQS) it refuses: masked wherever a URL appears in its message.
_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)\S*@")
_URL_QUERY = re.compile(r"([?&][^=\s&#?]+=)[^\s&#]*")


def _without_credentials(text: str) -> str:
    """``text`` with the credentials and query values of the URLs in it masked (``http://***@host/?a=***``)."""
    return _URL_QUERY.sub(r"\1***", _URL_CREDENTIALS.sub(r"\1***@", text))


def sqs_client(options: SqsTransportOptions) -> Any:
    """A boto3 SQS client for ``options`` (the AWS environment supplies what they leave out)."""
    try:
        import boto3
    except ImportError:  # pragma: no cover - boto3 is a dependency of runlane-sqs
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID, "The SQS transport needs boto3; install runlane-sqs with its dependencies."
        ) from None
    from botocore.config import Config

    config = Config(
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        retries={"total_max_attempts": 3, "mode": "standard"},  # three tries in all (max_attempts counts retries)
    )
    try:
        session = boto3.session.Session(profile_name=options.profile) if options.profile else boto3.session.Session()
        return session.client("sqs", region_name=options.region, endpoint_url=options.endpoint_url, config=config)
    except Exception as error:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Cannot create the SQS client: {type(error).__name__}: {_without_credentials(str(error)).rstrip('.')}. "
            "Set [lane.sqs] region "
            "(region = \"${AWS_REGION}\" for AWS_REGION, which boto3 does not read) or AWS_DEFAULT_REGION, and check "
            "endpoint_url and profile.",
            meta={"table": "lane.sqs"},
        ) from None


def create_sqs_transport(options: SqsTransportOptions, context: ProviderContext | None = None) -> SqsTransport:
    from .transport import sqs_transport

    bindings = []
    for queue, table in options.queues.items():
        fifo = None if table.fifo is None else SqsFifoOptions(table.fifo.message_group, table.fifo.deduplication)
        bindings.append(
            sqs_queue(
                queue,
                queue_url=table.queue_url,
                queue_name=table.queue_name,
                queue_owner_aws_account_id=table.queue_owner_aws_account_id,
                fifo=fifo,
            )
        )
    return sqs_transport(client=sqs_client(options), queues=bindings, batch_size=options.batch_size, name=options.name)


def create_postgres_sqs_lane(options: PostgresSqsLaneOptions, context: ProviderContext) -> Lane:
    from .lane import postgres_sqs_lane

    postgres = options.postgres
    return postgres_sqs_lane(
        postgres={
            "connection_string": postgres.connection_string,
            "schema": postgres.schema,
            "min_size": postgres.min_size,
            "max_size": postgres.max_size,
            "name": postgres.name,
            "connect_timeout": postgres.connect_timeout,
            "statement_timeout": postgres.statement_timeout,
            "pool_timeout": postgres.pool_timeout,
        },
        sqs=create_sqs_transport(options.sqs, context),
        name=options.name,
    )


@hookimpl
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("postgres-sqs", PostgresSqsLaneOptions, create_postgres_sqs_lane))


@hookimpl
def register_transports(register: Callable[[TransportProvider], None]) -> None:
    register(TransportProvider("sqs", SqsTransportOptions, create_sqs_transport))


# ---------------------------------------------------------------------------------------------
# runlane sqs consume

sqs_cli = typer.Typer(help="SQS wakeups: consume them.", no_args_is_help=True)

MaxMessagesOption = Annotated[
    int, typer.Option("--max-messages", min=1, max=10, help="Messages per ReceiveMessage call.", metavar="N")
]
WaitTimeOption = Annotated[
    int, typer.Option("--wait-time", min=0, max=20, help="Long-poll seconds per ReceiveMessage call.", metavar="S")
]
VisibilityTimeoutOption = Annotated[
    int | None,
    typer.Option(
        "--visibility-timeout",
        min=0,
        max=43200,
        help="Visibility timeout of received messages in seconds (default: the queue's); longer than a delivery.",
        metavar="S",
    ),
]

# A consumer that lost SQS (network, throttling) is started again after this backoff, doubling up to the cap.
_RESTART_DELAY_S = 1.0
_MAX_RESTART_DELAY_S = 30.0


@sqs_cli.command("consume", cls=MultiValueCommand, short_help="Execute the runs the SQS wakeups name, until stopped.")
def consume(
    ctx: typer.Context,
    queue: QueuesOption = None,
    max_messages: MaxMessagesOption = 10,
    wait_time: WaitTimeOption = 20,
    visibility_timeout: VisibilityTimeoutOption = None,
    lease_duration: LeaseDurationOption = None,
    heartbeat_interval: HeartbeatIntervalOption = None,
    worker_id: WorkerIdOption = None,
    health_file: HealthFileOption = None,
) -> None:
    """Receive the SQS wakeups of the configured postgres-sqs lane and execute their runs (until stopped).

    One consumer per bound SQS queue; a message is deleted once its delivery resolved. Run `runlane tick
    --every 30s` beside it for retries, schedules and recovery."""
    from runlane.cli.main import state_of, with_runtime

    from .consume import consume_wakeups

    check_lease_options(ctx, lease_duration, heartbeat_interval)
    output = state_of(ctx).output
    options = {
        "lease_duration": lease_duration,
        "heartbeat_interval": heartbeat_interval,
        "worker_id": worker_id,
    }

    async def body(runtime: Any) -> int:
        return await consume_wakeups(
            runtime,
            output,
            queues=list(queue or []),
            delivery_options={key: value for key, value in options.items() if value is not None},
            max_number_of_messages=max_messages,
            wait_time_seconds=wait_time,
            visibility_timeout_seconds=visibility_timeout,
            restart_delay=(_RESTART_DELAY_S, _MAX_RESTART_DELAY_S),
        )

    with_runtime(ctx, body, wait_for_storage=True, health_file=health_file)


@hookimpl
def register_commands(app: Any) -> None:
    add_typer = getattr(app, "add_typer", None)
    if callable(add_typer):
        add_typer(sqs_cli, name="sqs")

