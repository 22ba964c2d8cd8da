"""Runlane's type information as users' type checkers see it, and the packages' own type check.

The packages (the ``[tool.mypy]`` files of ``pyproject.toml``) must pass mypy. The programs in
``tests/typing/`` are checked with ``mypy --strict`` in a subprocess: the annotated application and
plugin must pass cleanly, and every mistake in ``misuse.py`` must be reported on its line with its error
code (so the test fails if the types go missing or turn into ``Any``). Packages that import their names on
first use must still declare every one of them to checkers, and hide their module ``__getattr__`` from them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ROOT / "tests" / "typing"

_EXPECT = re.compile(r"#\s*expect:\s*\[([a-z-]+)\]$")
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    # Run outside the checkout, so that the packages are found installed, as a user's checker finds them
    # (inside it mypy would read the source folders directly and never look for the py.typed markers).
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-error-summary", *arguments],
        cwd=cache,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _errors(output: str) -> set[tuple[str, int, str]]:
    errors = set()
    for line in output.splitlines():
        match = _ERROR.match(line)
        if match is not None:
            errors.add((Path(match["path"]).name, int(match["line"]), match["code"]))
    return errors


@pytest.mark.parametrize("program", ["user_app.py", "third_party_plugin.py"])
def test_a_program_written_as_the_guides_show_passes_strict_checking(program: str, mypy_cache: Path) -> None:
    result = _mypy(mypy_cache, "--strict", str(PROGRAMS / program))
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistakes_against_the_public_api_are_reported_where_they_are(mypy_cache: Path) -> None:
    source = PROGRAMS / "misuse.py"
    expected = {
        (source.name, number, match[1])
        for number, text in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1)
        if (match := _EXPECT.search(text)) is not None
    }
    assert len(expected) >= 10
    result = _mypy(mypy_cache, "--strict", str(source))
    assert _errors(result.stdout) == expected, result.stdout + result.stderr


def test_the_packages_pass_their_own_type_check(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path), "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Packages that import names on first use (a module ``__getattr__``), with the table it looks them up in.
_LAZY_PACKAGES = {
    "runlane_postgres": "_EXPORTS",
    "runlane_otlp": "_EXPORTS",
    "runlane.testing": "_SUITES",
}


def _type_checking_imports(tree: ast.Module) -> set[str]:
    """The names a module imports under ``if TYPE_CHECKING:`` (what a checker sees in place of ``__getattr__``)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    names.update(alias.asname or alias.name for alias in statement.names)
    return names


def _literal_all(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None  # computed: a type checker cannot read it
            return list(value) if isinstance(value, list) else None
    return None


def _module_getattr_is_hidden(tree: ast.Module) -> bool:
    """True when no top-level ``def __getattr__`` is visible to a type checker (it sits under
    ``if not TYPE_CHECKING:``), so a misspelt import is reported instead of typed ``Any``."""
    if any(isinstance(node, ast.FunctionDef) and node.name == "__getattr__" for node in tree.body):
        return False
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.UnaryOp)
        and isinstance(node.test.op, ast.Not)
        and isinstance(node.test.operand, ast.Name)
        and node.test.operand.id == "TYPE_CHECKING"
        and any(isinstance(inner, ast.FunctionDef) and inner.name == "__getattr__" for inner in node.body)
        for node in tree.body
    )


@pytest.mark.parametrize("package", sorted(_LAZY_PACKAGES))
def test_a_lazy_package_declares_every_export_to_type_checkers(package: str) -> None:
    module = importlib.import_module(package)
    tree = ast.parse(Path(inspect.getfile(module)).read_text(encoding="utf-8"))
    exported = _literal_all(tree)
    assert exported is not None, f"{package}.__all__ must be a literal list, which type checkers can read"
    assert exported == list(module.__all__)
    lazy = set(getattr(module, _LAZY_PACKAGES[package]))
    assert lazy <= set(exported), f"lazily imported names missing from {package}.__all__: {lazy - set(exported)}"
    eager = {name for name in exported if name not in lazy}
    assert all(name in vars(module) for name in eager), f"{package}.__all__ names a name it neither imports nor loads"
    assert lazy <= _type_checking_imports(tree), f"{package}: import the lazy names under TYPE_CHECKING"
    assert _module_getattr_is_hidden(tree)


@pytest.mark.parametrize("package", sorted(_LAZY_PACKAGES))
def test_a_lazy_package_still_loads_its_names_on_first_use(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'misspelt'"):
        module.misspelt  # noqa: B018 - the lookup is the test
    with pytest.raises(ImportError):
        exec(f"from {package} import misspelt", {})


def test_the_command_line_is_built_on_first_use_and_hidden_from_type_checkers() -> None:
    import typer

    import runlane.cli.main as main

    tree = ast.parse(Path(inspect.getfile(main)).read_text(encoding="utf-8"))
    assert _module_getattr_is_hidden(tree)
    assert isinstance(main.app, typer.Typer)
    with pytest.raises(AttributeError, match="no attribute 'ap'"):
        main.ap  # noqa: B018 - the lookup is the test


def test_each_name_literal_lists_exactly_its_enums_values() -> None:
    """The ``Literal`` types that let callers name enum members by their text stay equal to the enums."""
    from typing import get_args

    from runlane import vocabulary

    for name in [name for name in vocabulary.__all__ if name.endswith("Name")]:
        enum = getattr(vocabulary, name.removesuffix("Name"))
        assert sorted(get_args(getattr(vocabulary, name))) == sorted(member.value for member in enum), name
