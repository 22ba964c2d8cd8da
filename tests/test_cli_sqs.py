"""``runlane sqs consume`` and the ``postgres-sqs`` lane of ``runlane.toml``, through real ``runlane`` processes.

Each project gets a freshly migrated schema on the session's PostgreSQL server and an SQS queue with a
unique name on the session's SQS-compatible server (moto). The child processes find the server's dummy
AWS credentials in their environment (``cli_support`` passes this process's environment on).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from cli_support import background, cli, make_project, wait_for, write

TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("ping")
def ping(payload: dict) -> dict:
    return {"pong": True}
"""

EMAILS_TASK = """

emails = queue("emails")


@task("emails.send", queue=emails)
def send(payload: dict) -> dict:
    return {"sent": True}
"""


def sqs_config(url: str, schema: str, endpoint_url: str, queues: dict[str, str], *, extra_sqs: str = "") -> str:
    tables = "".join(f'\n[lane.sqs.queues.{name}]\nqueue_url = "{queue_url}"\n' for name, queue_url in queues.items())
    return (
        f'[runlane]\ntasks = ["app_tasks"]\n\n[lane]\nuse = "postgres-sqs"\n\n'
        f'[lane.postgres]\nconnection_string = "{url}"\nschema = "{schema}"\n\n'
        f'[lane.sqs]\nregion = "us-east-1"\nendpoint_url = "{endpoint_url}"\n{extra_sqs}{tables}'
    )


class SqsProject:
    """A project directory configured for the postgres-sqs lane, with its bound SQS queue."""

    def __init__(self, root: Path, postgres_url: str, schema: str, sqs_server: Any) -> None:
        self.root = root
        self.postgres_url = postgres_url
        self.schema = schema
        self.sqs_server = sqs_server
        self.queue_url = sqs_server.create_queue(f"runlane-cli-{uuid.uuid4().hex[:16]}")
        write(root / "app_tasks.py", TASKS)
        self.configure()

    def configure(self, *, extra_sqs: str = "") -> None:
        config = sqs_config(
            self.postgres_url, self.schema, self.sqs_server.endpoint_url, {"default": self.queue_url},
            extra_sqs=extra_sqs,
        )  # fmt: skip
        write(self.root / "runlane.toml", config)

    def messages(self) -> int:
        """Messages on the queue, visible or in flight."""
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        attributes = self.sqs_server.client().get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=names)
        return sum(int(attributes["Attributes"][name]) for name in names)


@pytest.fixture
def project(tmp_path: Path, postgres_url: str, sqs_server: Any, monkeypatch: pytest.MonkeyPatch) -> SqsProject:
    from postgres_support import migrated_schema

    for name, value in sqs_server.environment().items():
        monkeypatch.setenv(name, value)  # cli_support hands this process's environment to every runlane it starts
    return SqsProject(tmp_path / "project", postgres_url, migrated_schema(postgres_url, "sqs_cli"), sqs_server)


def assert_clean_configuration_error(result: Any, *fragments: str) -> None:
    """Exit status 1, one ``configuration_invalid`` line naming every fragment, no traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert result.stderr.startswith("error[configuration_invalid]: "), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_sqs_consume_executes_a_triggered_run_and_exits_cleanly_on_sigterm(project: SqsProject, tmp_path: Path) -> None:
    triggered = cli(project.root, "--json", "trigger", "ping", "{}")
    assert triggered.returncode == 0, triggered.stderr
    run = json.loads(triggered.stdout)["run"]
    assert run["status"] == "queued"
    assert project.messages() == 1  # the trigger published its wakeup

    with background(project.root, "sqs", "consume", "--wait-time", "1", log=tmp_path / "consume.log") as consumer:
        started = consumer.wait_for("consumer_started")
        assert started["queues"] == ["default"] and started["queue_url"] == project.queue_url
        executed = consumer.wait_for("run")
        assert executed["run"]["id"] == run["id"]
        assert executed["run"]["status"] == "succeeded" and executed["run"]["output"] == {"pong": True}
        assert consumer.stop() == 0
        records = consumer.records()
    ending = [record["type"] for record in records if record["type"] != "receive_wait"][-2:]
    assert ending == ["stopping", "consumer_stopped"], records
    assert records[-1]["runs"] == 1
    assert project.messages() == 0  # deleted once its delivery resolved

    stored = cli(project.root, "--json", "runs", "get", run["id"])
    assert stored.returncode == 0, stored.stderr
    assert json.loads(stored.stdout)["run"]["status"] == "succeeded"


def test_a_stopping_sqs_consume_hands_back_the_wakeup_its_last_long_poll_receives(
    project: SqsProject, tmp_path: Path
) -> None:
    # SQS hands a wakeup that arrives during a long poll to that poll even when its process has gone: the
    # command stays until the poll returns and makes the wakeup visible for the next consumer at once.
    with background(project.root, "sqs", "consume", "--wait-time", "10", log=tmp_path / "consume.log") as consumer:
        consumer.wait_for("consumer_started")
        time.sleep(0.5)  # the 10-second receive is in flight
        consumer.process.send_signal(signal.SIGTERM)
        waiting = consumer.wait_for("receive_wait")
        assert (waiting["queue_url"], waiting["wait_seconds"]) == (project.queue_url, 10)
        project.sqs_server.client().send_message(QueueUrl=project.queue_url, MessageBody="{}")
        assert consumer.process.wait(timeout=30) == 0
        assert consumer.records()[-1]["type"] == "consumer_stopped"
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    attributes = project.sqs_server.client().get_queue_attributes(QueueUrl=project.queue_url, AttributeNames=names)
    assert [attributes["Attributes"][name] for name in names] == ["1", "0"]


BATCH_TASK = """

batch = queue("batch", concurrency_limit=1)


@task("batch.run", queue=batch)
def batch_run(payload: dict) -> dict:
    return {}
"""


def test_tick_every_reports_a_queue_name_that_does_not_resolve_and_goes_on(project: SqsProject, tmp_path: Path) -> None:
    # One queue whose wakeups SQS cannot take must not stop the maintenance of every other queue.
    missing = f"runlane-missing-{uuid.uuid4().hex[:12]}"
    write(project.root / "app_tasks.py", TASKS + BATCH_TASK)
    project.configure(extra_sqs=f'\n[lane.sqs.queues.batch]\nqueue_name = "{missing}"\n')
    triggered = cli(project.root, "trigger", "batch.run", "{}")  # bounded: tick() reserves it and publishes
    assert triggered.returncode == 0, triggered.stderr

    with background(project.root, "tick", "--every", "100ms", log=tmp_path / "tick.log") as maintenance:
        failed = maintenance.wait_for("tick_failed")
        assert failed["error_code"] == "configuration_invalid" and missing in failed["error_message"]

        def passes_after_the_failure() -> int:
            kinds = [record["type"] for record in maintenance.records()]
            return kinds[kinds.index("tick_failed") :].count("tick")

        wait_for(passes_after_the_failure, what="a maintenance pass after the refused publish")
        assert maintenance.stop() == 0
    assert maintenance.records()[-1]["type"] == "tick_loop_stopped"


def test_sqs_consume_on_a_polling_lane_points_at_runlane_work(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    result = cli(root, "sqs", "consume", "--wait-time", "1")
    assert_clean_configuration_error(result, "postgres-sqs", "`runlane work`")


def test_a_registered_queue_without_an_sqs_binding_is_a_configuration_error_naming_it(project: SqsProject) -> None:
    write(project.root / "app_tasks.py", TASKS + EMAILS_TASK)
    for command in (["sqs", "consume", "--wait-time", "1"], ["trigger", "ping", "{}"]):
        assert_clean_configuration_error(cli(project.root, *command), "'emails'")
    assert project.messages() == 0


def test_an_unknown_key_in_lane_sqs_is_reported_by_name(project: SqsProject) -> None:
    project.configure(extra_sqs='regoin = "eu-west-1"\n')
    assert_clean_configuration_error(cli(project.root, "sqs", "consume"), "regoin")


def test_sqs_consume_of_an_unbound_queue_names_it(project: SqsProject) -> None:
    result = cli(project.root, "sqs", "consume", "--queue", "nope", "--wait-time", "1")
    assert_clean_configuration_error(result, "'nope'", "'default'")


def test_a_polling_worker_on_the_sqs_lane_says_it_leaves_the_messages_alone(project: SqsProject) -> None:
    triggered = cli(project.root, "--json", "trigger", "ping", "{}")
    assert triggered.returncode == 0, triggered.stderr

    drained = cli(project.root, "work", "--drain")

    assert drained.returncode == 0, drained.stderr
    assert "never acknowledges those messages; run the transport's consumer (runlane sqs consume)" in drained.stdout
    assert "run succeeded" in drained.stdout
    assert project.messages() == 1  # executed from Postgres; the SQS message is left for its redrive policy


@pytest.mark.parametrize("bound_by", ["queue_name", "queue_url"])
def test_sqs_consume_started_before_sqs_answers_waits_for_it(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch, bound_by: str
) -> None:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.server import ThreadedMotoServer
    from moto.sqs.models import sqs_backends
    from postgres_support import migrated_schema
    from runlane_sqs.testing import TEST_REGION, SqsTestServer

    # moto's server in this process, so the queue can exist before the server first answers: created
    # after the server starts, a consumer retrying at that moment would be told the queue does not exist.
    endpoint = SqsTestServer()  # only for a free port and the environment that points boto3 at it
    server = ThreadedMotoServer(ip_address=endpoint.host, port=endpoint.port, verbose=False)
    for name, value in endpoint.environment().items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "project"
    write(root / "app_tasks.py", TASKS)
    queue_name = f"runlane-late-{uuid.uuid4().hex[:12]}"
    url = f"{endpoint.endpoint_url}/{DEFAULT_ACCOUNT_ID}/{queue_name}"
    binding = queue_name if bound_by == "queue_name" else url
    config = sqs_config(postgres_url, migrated_schema(postgres_url, "sqs_late"), endpoint.endpoint_url, {})
    write(root / "runlane.toml", config + f'\n[lane.sqs.queues.default]\n{bound_by} = "{binding}"\n')
    backend = sqs_backends[DEFAULT_ACCOUNT_ID][TEST_REGION]
    started_server = False
    try:
        with background(root, "sqs", "consume", "--wait-time", "1", log=tmp_path / "late.log") as consumer:
            waiting = consumer.wait_for("sqs_waiting")
            assert waiting["error_code"] == "transport_unavailable"
            backend.create_queue(queue_name)
            server.start()
            started_server = True
            started = consumer.wait_for("consumer_started")
            assert started["queue_url"] == url
            triggered = cli(root, "--json", "trigger", "ping", "{}")
            assert triggered.returncode == 0, triggered.stderr
            executed = consumer.wait_for("run")
            assert executed["run"]["status"] == "succeeded"
            assert consumer.stop() == 0
    finally:
        if started_server:
            server.stop()
        backend.reset()


def test_sqs_consume_of_a_queue_url_that_does_not_exist_fails_at_start(project: SqsProject) -> None:
    missing = project.queue_url.rsplit("/", 1)[0] + f"/runlane-gone-{uuid.uuid4().hex[:12]}"
    text = (project.root / "runlane.toml").read_text().replace(project.queue_url, missing)
    write(project.root / "runlane.toml", text)
    result = cli(project.root, "sqs", "consume", "--wait-time", "1")
    assert_clean_configuration_error(result, "does not exist", missing)


def test_sqs_consume_stopped_while_waiting_for_sqs_exits_cleanly(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from postgres_support import migrated_schema
    from runlane_sqs.testing import SqsTestServer

    server = SqsTestServer()  # never started
    for name, value in server.environment().items():
        monkeypatch.setenv(name, value)
    root = tmp_path / "project"
    write(root / "app_tasks.py", TASKS)
    config = sqs_config(postgres_url, migrated_schema(postgres_url, "sqs_stop"), server.endpoint_url, {})
    write(root / "runlane.toml", config + '\n[lane.sqs.queues.default]\nqueue_name = "never-there"\n')
    with background(root, "sqs", "consume", log=tmp_path / "stop.log") as consumer:
        consumer.wait_for("sqs_waiting")
        assert consumer.stop() == 0
        assert [record["type"] for record in consumer.records()][-1] == "consumer_stopped"


def test_sqs_consume_stopped_while_its_startup_check_hangs_exits_at_once(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An endpoint that takes the connection and never answers: each try of the startup check would wait
    # out read_timeout (30 s, three tries). SIGTERM stops the command at once, not when botocore gives up.
    import socket
    import threading

    from postgres_support import migrated_schema
    from runlane_sqs.testing import SqsTestServer

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    connected = threading.Event()
    held: list[socket.socket] = []

    def hold() -> None:
        try:
            while True:
                connection, _ = listener.accept()
                held.append(connection)  # read nothing, answer nothing
                connected.set()
        except OSError:
            return  # closed by the test, or no connection within the timeout

    threading.Thread(target=hold, daemon=True).start()
    try:
        server = SqsTestServer()  # only for the environment that points boto3 at a loopback endpoint
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)
        endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        root = tmp_path / "project"
        write(root / "app_tasks.py", TASKS)
        config = sqs_config(postgres_url, migrated_schema(postgres_url, "sqs_hang"), endpoint, {})
        write(root / "runlane.toml", config + '\n[lane.sqs.queues.default]\nqueue_name = "never-answered"\n')
        with background(root, "sqs", "consume", log=tmp_path / "hang.log") as consumer:
            assert connected.wait(30), consumer.log.read_text()
            time.sleep(0.2)  # the request is sent and waits for an answer
            assert consumer.stop(timeout=15) == 0, consumer.log.read_text()
            records = consumer.records()
        assert [record["type"] for record in records][-2:] == ["stopping", "consumer_stopped"], records
        assert "Traceback" not in consumer.log.read_text()
    finally:
        listener.close()
        for connection in held:
            connection.close()
