"""The ``runlane`` command line: Typer for structure, Rich for display (``runlane.cli.output``).

The core never imports this package. The console script enters through ``_runlane_entry:run`` (outside
the package, so a Ctrl-C while Runlane loads ends it quietly), which calls ``runlane.cli.main:run``.
"""
