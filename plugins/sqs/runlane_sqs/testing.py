"""A throwaway SQS-compatible server for tests: moto's server mode on a loopback port.

Needs the ``testing`` extra (``pip install 'runlane-sqs[testing]'``: moto, flask, flask-cors)::

    with SqsTestServer() as server:
        client = server.client()
        url = server.create_queue("runlane-default")
        ...

The server runs as a child process in its own session, answers the real SQS wire protocol (boto3
talks HTTP to it) and keeps everything in memory. ``stop()`` (or leaving the ``with`` block) stops it,
and kills it if need be; so does interpreter exit. No server outlives the process that started it: the
server watches a pipe from that process and exits once it is gone, however it went (``SIGKILL``, a
crash). Every wait is bounded. Credentials are dummies; traffic never leaves the loopback interface.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["TEST_CREDENTIALS", "SqsTestServer"]

TEST_REGION = "us-east-1"
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": TEST_REGION,
}


# The server's process: moto's server mode, plus a thread that ends the process once its standard input, a
# pipe from the process that started it, reaches end of file: when stop() closes it, or when that process
# is gone and the system closed it (a SIGKILL, a crash), so no server is left behind holding its port.
_LAUNCHER = r"""
import os, sys, threading
def watch():
    try:
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        os._exit(0)
threading.Thread(target=watch, daemon=True).start()
from moto.server import main
main(sys.argv[1:])
"""


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class SqsTestServer:
    """moto's SQS-compatible HTTP server on ``host``:``port`` (a free port by default)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0) -> None:
        self.host = host
        self.port = port if port is not None else _free_port(host)
        self.startup_timeout = startup_timeout
        self.region = TEST_REGION
        self._process: subprocess.Popen[bytes] | None = None
        self._log = Path(tempfile.gettempdir()) / f"runlane-sqs-server-{os.getpid()}-{self.port}.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> SqsTestServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> SqsTestServer:
        """Start the server and wait until it answers SQS calls (at most ``startup_timeout`` seconds)."""
        if self.running:
            return self
        missing = [name for name in ("moto", "flask", "flask_cors") if importlib.util.find_spec(name) is None]
        if missing:
            raise RuntimeError(
                f"The SQS test server runs moto's server mode, which needs {', '.join(missing)}: install the "
                "plugin's testing extra (pip install 'runlane-sqs[testing]')."
            )
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, "-H", self.host, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE,
                start_new_session=True,
            )
        atexit.register(self.stop)
        deadline = time.monotonic() + self.startup_timeout
        client = self.client()
        while True:
            if self._process.poll() is not None:
                status, tail = self._process.returncode, self.log_tail()
                self.stop()
                raise RuntimeError(f"The SQS test server exited with status {status}:\n{tail}")
            try:
                client.list_queues()
                return self
            except Exception as error:  # not listening yet
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(
                        f"The SQS test server did not answer within {self.startup_timeout:g}s ({error!r}):\n{tail}"
                    ) from None
                time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` seconds) and remove its log."""
        process, self._process = self._process, None
        atexit.unregister(self.stop)
        if process is not None and process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the server ends itself on end of file
        if process is None or process.poll() is not None:
            self._log.unlink(missing_ok=True)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout)
        self._log.unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def client(self, **config: Any) -> Any:
        """A boto3 SQS client for this server, with dummy credentials and short timeouts."""
        import boto3
        from botocore.config import Config

        settings = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 1}, **config}
        return boto3.client(
            "sqs",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=Config(**settings),
        )

    def create_queue(self, name: str, *, fifo: bool = False, **attributes: str) -> str:
        """Create a queue (a FIFO one when ``fifo``; ``name`` then ends in ``.fifo``) and return its URL."""
        if fifo:
            attributes.setdefault("FifoQueue", "true")
        response = self.client().create_queue(QueueName=name, Attributes=attributes)
        return str(response["QueueUrl"])

    def environment(self) -> dict[str, str]:
        """Environment variables that point a child process's boto3 at this server."""
        return {**TEST_CREDENTIALS, "AWS_ENDPOINT_URL_SQS": self.endpoint_url}
