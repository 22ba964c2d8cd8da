"""The ``runlane`` console script's entry point: a module outside the ``runlane`` package on purpose.

Importing ``runlane`` takes a few tenths of a second (its models, the runtime, the command line). A
Ctrl-C meanwhile would end the process with the traceback of whichever module was loading. This module
imports nothing of Runlane's before its handler is in place, so such an interrupt ends the command with
status 130 and no output, as one while the command runs does.
"""

from __future__ import annotations

__all__ = ["run"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command a Ctrl-C ended


def run() -> None:
    """Console-script entry point: ``runlane.cli.main.run`` once it is imported."""
    try:
        from runlane.cli.main import run as main
    except KeyboardInterrupt:
        raise SystemExit(EXIT_INTERRUPTED) from None
    main()
