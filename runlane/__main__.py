"""``python -m runlane``: the same command line as the ``runlane`` script."""

from runlane.cli.main import run

if __name__ == "__main__":
    run()
