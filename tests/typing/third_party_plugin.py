"""A third-party plugin written the way ``docs/plugin-hooks.md`` shows, fully annotated.

``tests/test_typing.py`` type-checks it with ``mypy --strict``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer
from pydantic import BaseModel, ConfigDict

from runlane import Lane, Runlane, RunlaneObservation
from runlane.cli.main import with_runtime
from runlane.plugins import hookimpl
from runlane.plugins.registries import ExporterProvider, LaneProvider, ProviderContext
from runlane.testing import StorageDriverConformance
from runlane_local import sqlite_lane


class ExampleLaneOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str


def create_example_lane(options: ExampleLaneOptions, context: ProviderContext) -> Lane:
    base = context.base_dir or Path.cwd()
    return sqlite_lane(str(base / options.path), name="example")


@hookimpl
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("example", ExampleLaneOptions, create_example_lane))


def count_observations(observation: RunlaneObservation) -> None:
    print(observation.type, observation.run_id)


@hookimpl
def register_observers(register: Callable[[Callable[[RunlaneObservation], None]], None]) -> None:
    register(count_observations)


@hookimpl
def register_task_modules(register: Callable[[str], None]) -> None:
    register("example_plugin.tasks")


@hookimpl
def register_exporters(register: Callable[[ExporterProvider], None]) -> None:
    del register  # this plugin exports nothing; the hook is here to show its signature


@hookimpl
def register_commands(app: typer.Typer) -> None:
    @app.command("backlog")
    def backlog(ctx: typer.Context) -> None:
        """Print how many runs are queued."""

        async def body(runtime: Runlane) -> None:
            page = await runtime.runs.list(statuses=["queued"], limit=100)
            typer.echo(f"{len(page.data)}{'+' if page.next_cursor else ''} queued")

        with_runtime(ctx, body)


def command_line() -> typer.Typer:
    from runlane.cli.main import app

    return app


class ExampleDriverConformance(StorageDriverConformance):
    """The storage contract suite, subclassed as ``docs/testing-a-storage-driver.md`` shows."""

    supports_operator_reads = True
