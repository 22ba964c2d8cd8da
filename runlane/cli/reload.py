"""``runlane dev --reload``: restart ``runlane dev`` whenever the project's code or config changes.

This process never loads the runtime. It runs ``runlane dev`` (the same arguments, without
``--reload``) as a child process and watches the directory of the config file: every ``*.py`` file
below it and the config file itself. Hidden directories, ``__pycache__``, ``node_modules``,
``site-packages`` and virtual environments (a directory with ``pyvenv.cfg``) are skipped. Watching is
by modification time, polled twice a second, so it needs no file-system notification support and
behaves the same on every platform and file system (containers and network mounts included).

On a change the child is stopped the way a process manager stops ``runlane dev``: SIGTERM, so runs in
progress finish their attempt; a second SIGTERM after ``stop_timeout`` exits it at once (a run left
``running`` is then taken over when its lease expires). A new child starts with the new code. A child
that exits by itself, an import error in a task module for instance, is reported and restarted on
the next change, so fixing the file is enough.

The child runs in its own process group: Ctrl-C in a terminal reaches only this process, which
forwards it, so the child sees one signal per keypress (a first one stops it gracefully, a second at
once) just as without ``--reload``. While a restart is stopping the child, that child is already
stopping gracefully: a first Ctrl-C then only cancels the restart (and lifts the ``stop_timeout``), and a
second is forwarded to exit it at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .main import STOP_SIGNALS
from .output import Output

__all__ = ["RELOAD_CHILD_ENV", "Reloader", "watched_files"]

RELOAD_CHILD_ENV = "RUNLANE_DEV_RELOAD_CHILD"
"""Set (to ``1``) in the environment of the ``runlane dev`` a supervisor runs: that process, which loads the
runtime, then knows that each change restarts it, and says so when its lane keeps runs in memory."""

_SKIPPED_DIRECTORIES = frozenset({"__pycache__", "node_modules", "site-packages"})
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def watched_files(root: Path, extra: Sequence[Path] = ()) -> dict[str, int]:
    """Modification time (ns) of every ``*.py`` file under ``root`` and of each ``extra`` file, by path."""
    found: dict[str, int] = {}
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [
            name
            for name in subdirectories
            if not name.startswith(".")
            and name not in _SKIPPED_DIRECTORIES
            and not os.path.exists(os.path.join(directory, name, "pyvenv.cfg"))
        ]
        for name in names:
            if name.endswith(".py"):
                _stat_into(found, os.path.join(directory, name))
    for path in extra:
        _stat_into(found, str(path))
    return found


def _stat_into(found: dict[str, int], path: str) -> None:
    try:
        found[path] = os.stat(path).st_mtime_ns
    except OSError:  # removed between listing and stat: its absence is the change
        pass


def _changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


class Reloader:
    """Runs ``command`` as a child process and restarts it when a watched file changes."""

    def __init__(
        self,
        output: Output,
        command: Sequence[str],
        root: Path,
        config: Path,
        *,
        poll_interval: float = 0.5,
        settle: float = 0.2,
        stop_timeout: float = 10.0,
    ) -> None:
        self.output = output
        self.command = list(command)
        self.root = root
        self.config = config
        self.poll_interval = poll_interval
        self.settle = settle  # an editor or a git checkout writes several files: wait for the last of them
        self.stop_timeout = stop_timeout
        self._child: subprocess.Popen[bytes] | None = None
        self._stop_signals = 0
        self._restarting = False  # the child is being stopped for a restart (with SIGTERM, gracefully)

    def run(self) -> int:
        """Until SIGINT/SIGTERM: the child's exit status then (0 when no child was running)."""
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            files = self._snapshot()
            self.output.record(
                "reload_watching",
                f"watching {len(files)} files under {self.root} (*.py and {self.config.name}); "
                "runlane dev restarts when one changes",
                root=str(self.root),
                files=len(files),
            )
            self._start()
            while not self._stop_signals:
                time.sleep(self.poll_interval)
                if self._stop_signals:
                    break
                current = self._snapshot()
                changed = _changed(files, current)
                if changed:
                    time.sleep(self.settle)
                    current = self._snapshot()
                    changed = _changed(files, current) or changed
                    files = current
                    self._restart(changed)
                    continue
                status = self._child.poll() if self._child is not None else None
                if status is not None and not self._stop_signals:  # not the exit a forwarded signal asked for
                    self._child = None
                    self.output.record(
                        "dev_exited",
                        f"runlane dev exited with status {status}; waiting for a change to restart it",
                        status=status,
                    )
            return self._wait_for_child()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._kill_child()

    def _snapshot(self) -> dict[str, int]:
        return watched_files(self.root, [self.config])

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_signals += 1
        child = self._child
        if child is None or child.poll() is not None:
            return
        if self._restarting and self._stop_signals == 1:
            # It already stops gracefully; forwarded, this would be its second signal and end its runs.
            name = signal.Signals(signum).name
            self.output.record(
                "stopping", f"received {name}; stopping after current runs (send again to exit now)", signal=name
            )
            return
        child.send_signal(signum)  # the child reports it and stops (or, on a second one, exits at once)

    def _start(self) -> None:
        # Its own process group, so a terminal's Ctrl-C reaches it once, through _on_signal; and it is
        # stopped if this process dies without being able to stop it (kill -9).
        self._child = subprocess.Popen(
            self.command,
            env={**os.environ, RELOAD_CHILD_ENV: "1"},
            process_group=0,
            preexec_fn=_stop_with_parent,
        )
        if self._stop_signals:  # a signal that came while it was starting was not forwarded
            self._child.send_signal(signal.SIGTERM)

    def _restart(self, changed: list[str]) -> None:
        names = [self._display(path) for path in changed]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        self.output.record("reloading", f"{shown} changed; restarting runlane dev", changed=names)
        self._restarting = True
        try:
            self._stop_child()
        finally:
            self._restarting = False
        if not self._stop_signals:
            self._start()

    def _display(self, path: str) -> str:
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return path

    def _stop_child(self) -> None:
        child = self._child
        if child is None or child.poll() is not None:
            return
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=self.stop_timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        if self._stop_signals:  # asked to stop meanwhile: wait for its runs as without --reload (run() does)
            return
        self.output.record(
            "reload_forced",
            f"runlane dev did not stop within {self.stop_timeout:g}s; stopping it at once "
            "(a run still running is taken over when its lease expires)",
        )
        child.send_signal(signal.SIGTERM)  # the second signal: exit now
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=5)

    def _wait_for_child(self) -> int:
        child = self._child
        if child is None:  # it had exited by itself, and that was reported
            return 0
        # Stopping: the signal was forwarded; the child finishes its runs or, on a second signal, exits.
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue

    def _kill_child(self) -> None:
        child = self._child
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(timeout=5)


def _stop_with_parent() -> None:
    """In the child before exec: on Linux, SIGTERM it when the process that started it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def child_command(args: Sequence[str]) -> list[str]:
    """``runlane ARGS`` without ``--reload``, run by this interpreter.

    ``-P`` keeps the working directory off the front of ``sys.path``, as it is for the ``runlane`` script:
    else a ``runlane.py`` (or ``runlane/``) of the project would be run in place of Runlane.
    """
    return [sys.executable, "-P", "-m", "runlane", *(arg for arg in args if arg != "--reload")]
