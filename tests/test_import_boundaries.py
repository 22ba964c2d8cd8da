"""Import boundaries: the core and the storage contract stay free of UI, provider SDK and plugin imports.

Each check runs in a fresh interpreter so modules imported by other tests cannot hide or fake a leak.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN_IN_CORE = (
    "typer", "rich", "textual", "psycopg", "psycopg2", "boto3", "botocore", "opentelemetry",
    "runlane_local", "runlane_postgres", "runlane_sqs", "runlane_otlp",
)


def imported_modules(code: str) -> list[str]:
    """Run ``code`` in a clean interpreter and return the names in ``sys.modules`` afterwards."""
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    completed = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def leaked(modules: list[str], roots: tuple[str, ...]) -> list[str]:
    return [name for name in modules if name.split(".")[0] in roots]


def test_core_and_storage_import_no_ui_provider_or_plugin_packages():
    modules = imported_modules("import runlane, runlane.storage, runlane.testing.clock")
    assert "runlane.storage" in modules
    assert leaked(modules, FORBIDDEN_IN_CORE) == []


def test_storage_contract_does_not_import_the_core_runtime():
    # Load ``runlane.storage`` without executing ``runlane/__init__.py`` (which will re-export the
    # runtime) so only the storage package's own import graph is measured.
    modules = imported_modules(
        f"""
        import importlib, sys, types
        package = types.ModuleType("runlane")
        package.__path__ = [{str(REPO_ROOT / "runlane")!r}]
        sys.modules["runlane"] = package
        importlib.import_module("runlane.storage")
        """
    )
    assert "runlane.storage" in modules
    runtime = [name for name in modules if name.startswith(("runlane.core", "runlane.runtime", "runlane.cli", "runlane.tui", "runlane.plugins"))]
    assert runtime == []
    assert leaked(modules, FORBIDDEN_IN_CORE) == []


def test_boundary_check_detects_a_leak():
    # Guard against a vacuous check: the same probe sees a module that really is imported.
    modules = imported_modules("import json, runlane.storage")
    assert leaked(modules, ("json",)) != []


def test_cli_loads_no_textual_until_the_dashboard_runs():
    modules = imported_modules("import runlane.cli.main")
    assert "typer" in modules  # the probe really imported the CLI
    assert leaked(modules, ("textual",)) == []


def test_only_the_dashboard_package_imports_textual():
    import re

    pattern = re.compile(r"^\s*(from|import)\s+textual\b", re.MULTILINE)
    sources = [*(REPO_ROOT / "runlane").rglob("*.py"), *(REPO_ROOT / "plugins").rglob("*.py")]
    importing = sorted(
        str(path.relative_to(REPO_ROOT)) for path in sources if pattern.search(path.read_text(encoding="utf-8"))
    )
    assert importing, "the dashboard imports textual: the check must see it"
    assert [path for path in importing if not path.startswith("runlane/tui/")] == []


def test_the_runtime_does_not_load_the_dashboard():
    modules = imported_modules("import runlane, runlane.config, runlane_local, runlane_postgres, runlane_sqs")
    assert leaked(modules, ("textual",)) == []
    assert [name for name in modules if name.startswith("runlane.tui")] == []


def test_loading_the_plugins_imports_no_provider_sdk():
    # Every `runlane` command loads every plugin: SDKs load only when a lane or exporter is created.
    modules = imported_modules("from runlane.plugins.manager import get_registries; get_registries()")
    assert "runlane_otlp.plugin" in modules and "runlane_sqs.plugin" in modules
    assert leaked(modules, ("opentelemetry", "boto3", "botocore", "psycopg", "textual")) == []
