"""The installed distributions work with only what they declare: a user's ``pip install`` brings the
requirements of ``runlane[tui]`` and the plugin distributions, not this repository's test tools.

The development environment also holds the test extra and what the test servers need (pytest, moto,
Flask, and with them Click, which Typer no longer requires). Each check here runs the ``runlane``
command in a fresh interpreter where every top-level module that only such undeclared distributions
provide cannot be imported, as in a fresh install, so a leaked import fails here instead of there. The
source of each distribution is also read for imports its own requirements do not bring (on paths no command
here runs, or from a sibling plugin's requirements), and the declared lower bounds are kept at releases
runlane works with.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from cli_support import cli_env, make_project

# What a user installs: every lane, the dashboard and the exporters (README, "In a project of your own").
INSTALLED = (
    ("runlane", ("tui",)),
    ("runlane-local", ()),
    ("runlane-postgres", ()),
    ("runlane-sqs", ()),
    ("runlane-otlp", ()),
)


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared_closure(installed: tuple[tuple[str, tuple[str, ...]], ...] = INSTALLED) -> set[str]:
    """The normalized names of the distributions ``installed`` brings, requirements of requirements too."""
    seen: set[str] = set()
    pending = [(name, extras) for name, extras in installed]
    while pending:
        name, extras = pending.pop()
        key = _name(name)
        if key in seen and not extras:
            continue
        seen.add(key)
        try:
            requirements = requires(name) or []
        except PackageNotFoundError:
            continue  # an optional requirement this environment lacks: nothing of it can leak
        for text in requirements:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra}) for extra in (*extras, "")):
                pending.append((requirement.name, tuple(requirement.extras)))
    return seen


def undeclared_modules() -> list[str]:
    """Top-level modules that only distributions outside ``declared_closure()`` provide."""
    declared = declared_closure()
    stdlib = set(sys.stdlib_module_names)
    return sorted(
        module
        for module, distributions in packages_distributions().items()
        if module.isidentifier()
        and module not in stdlib
        and not module.startswith(("runlane", "_runlane"))
        and not any(_name(distribution) in declared for distribution in distributions)
    )


def run_with_declared_only(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``runlane ARGS`` in ``cwd`` with every undeclared module unimportable (``ModuleNotFoundError``)."""
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys

        BLOCKED = frozenset({undeclared_modules()!r})

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())
        sys.argv = ["runlane", *{list(args)!r}]
        from _runlane_entry import run
        run()
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120, env=cli_env()
    )


def test_the_check_blocks_what_only_the_test_tools_bring():
    blocked = undeclared_modules()
    assert {"pytest", "moto"} <= set(blocked)
    assert not {"typer", "pydantic", "psycopg", "boto3", "textual", "opentelemetry"} & set(blocked)


def test_every_plugin_and_its_commands_load_with_only_the_declared_dependencies(tmp_path: Path):
    listed = run_with_declared_only(tmp_path, "--json", "plugins", "list")
    assert listed.returncode == 0, listed.stderr
    assert "skipped plugin" not in listed.stderr
    provided = {plugin["name"]: plugin["provides"] for plugin in json.loads(listed.stdout)["plugins"]}
    assert provided["postgres"]["commands"] == ["postgres"]
    assert provided["sqs"]["commands"] == ["sqs"]
    assert {"local", "postgres", "sqs", "otlp"} <= set(provided)

    sql = run_with_declared_only(tmp_path, "postgres", "sql", "--schema", "app")
    assert sql.returncode == 0, sql.stderr
    assert "CREATE TABLE" in sql.stdout


def test_a_project_on_a_sqlite_file_runs_with_only_the_declared_dependencies(tmp_path: Path):
    project = make_project(tmp_path, lane="sqlite")
    for args in (
        ("trigger", "emails.welcome", '{"user_id": "user_1"}'),
        ("dev", "--once"),
    ):
        completed = run_with_declared_only(project, *args)
        assert completed.returncode == 0, completed.stderr
    listed = run_with_declared_only(project, "--json", "runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert {run["status"] for run in json.loads(listed.stdout)["data"]} == {"succeeded"}


# The oldest release of each requirement that runlane's code was run against and works with: an older one
# that a declared lower bound lets pip pick breaks a fresh install that resolves to it (a constraints file,
# an older lock file, a Linux distribution's package). What each older release lacks is noted.
VERIFIED_MINIMUMS = {
    ".": {
        # Before 2.12 an option named `schema` left out is BaseModel.schema, not its default (the Postgres
        # lanes' option); before 2.9 some run events (run.failed) fail to serialize to JSON.
        "pydantic": "2.12",
        "croniter": "6",  # the first release to export CroniterError, which runlane.core.schedules imports
        # The first with typer.TyperException (runlane.cli.main); 0.12 refuses `Path | None` options and 0.15
        # an enum option's default.
        "typer": "0.28",
    },
    "plugins/postgres": {
        "psycopg": "3.3",  # 3.2's libpq wrapper refuses a tuple of statement parameters
    },
}
REPO = Path(__file__).resolve().parent.parent


def test_the_declared_lower_bounds_are_releases_runlane_works_with():
    for directory, minimums in VERIFIED_MINIMUMS.items():
        project = tomllib.loads((REPO / directory / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        declared = {_name(req.name): req for req in map(Requirement, project["dependencies"])}
        for name, minimum in minimums.items():
            specifier = declared[name].specifier
            lower = [Version(spec.version) for spec in specifier if spec.operator in (">=", "==", "~=")]
            assert lower, f"{project['name']}: {name} is declared without a lower bound"
            too_old = f"{project['name']}: {name}{specifier} allows releases before {minimum}"
            assert max(lower) >= Version(minimum), too_old


# Each distribution's code, and what it may import beyond what its own requirements bring, with why.
SOURCES = {
    "runlane": ("runlane", "_runlane_entry.py"),
    "runlane-local": ("plugins/local/runlane_local",),
    "runlane-postgres": ("plugins/postgres/runlane_postgres",),
    "runlane-sqs": ("plugins/sqs/runlane_sqs",),
    "runlane-otlp": ("plugins/otlp/runlane_otlp",),
}
ALSO_ALLOWED = {
    "runlane/tui/": {"textual"},  # the dashboard: the tui extra
    "runlane/testing/": {"pytest"},  # the conformance suites are pytest classes, for a plugin's own tests
    "runlane/config.py": {"tomli"},  # only on Python 3.10 and older, where the requirement's marker holds
}


def _python_files(source: Path) -> list[Path]:
    return [source] if source.suffix == ".py" else sorted(source.rglob("*.py"))


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names


def test_each_distribution_imports_only_what_its_own_requirements_bring():
    """Checked on the source, every module and function, so an import on a path no command above runs (the
    dashboard, the SQS consumer, an exporter) counts too, and a plugin installed without its siblings (say
    runlane-local alone) does not import what only another plugin's requirements bring."""
    providers = packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    leaks = []
    for distribution, sources in SOURCES.items():
        brought = declared_closure(((distribution, ()),))
        for path in (path for source in sources for path in _python_files(REPO / source)):
            relative = path.relative_to(REPO).as_posix()
            allowed = set().union(*(names for prefix, names in ALSO_ALLOWED.items() if relative.startswith(prefix)))
            for module in sorted(_top_level_imports(path) - stdlib - allowed):
                if _name(module) in brought:
                    continue
                if not any(_name(provider) in brought for provider in providers.get(module, ())):
                    leaks.append(f"{relative} imports {module}, which {distribution}'s requirements do not bring")
    assert not leaks, "\n".join(leaks)


def test_every_distribution_ships_the_license_text_its_metadata_names():
    root = Path(__file__).resolve().parents[1]
    text = (root / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License")
    for project in (root, *(path.parent for path in sorted(root.glob("plugins/*/pyproject.toml")))):
        assert 'license = "MIT"' in (project / "pyproject.toml").read_text(encoding="utf-8"), project
        assert (project / "LICENSE").read_text(encoding="utf-8") == text, f"{project}/LICENSE differs"
