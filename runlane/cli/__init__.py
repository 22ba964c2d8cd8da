"""The ``runlane`` command line: Typer for structure, Rich for display (``runlane.cli.output``).

The core never imports this package; ``runlane.cli.main:run`` is the console-script entry point.
"""
