"""The one plugin manager: core's default plugins plus the ``runlane`` entry-point group, loaded lazily.

``load_plugins()`` imports entry-point plugins once per process, honouring ``RUNLANE_LOAD_PLUGINS``
(a comma-separated allowlist of entry-point or distribution names; set but empty loads none).
A plugin that fails to import or register is reported on stderr in one line and skipped; it never
crashes the host. So is an entry point whose name another distribution's plugin already holds, and a
hook implementation no hookspec names is reported (its plugin's other hooks still work). This module
does not build lanes or read configuration.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import pluggy

from ..errors import ErrorCode, RunlaneError, describe_exception
from . import hookspecs
from .registries import Registries, collect_registries

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "FIRST_PARTY_PACKAGES",
    "HOOK_NAMES",
    "LOAD_PLUGINS_ENV",
    "PluginInfo",
    "PluginLoadFailure",
    "get_plugin_failures",
    "get_plugins",
    "get_registries",
    "load_entry_point_plugins",
    "load_plugins",
    "loading_plugins",
    "normalize_plugin_name",
    "plugin_allowlist",
    "pm",
    "runlane_compatible",
    "skip_plugin",
]

ENTRY_POINT_GROUP = "runlane"
LOAD_PLUGINS_ENV = "RUNLANE_LOAD_PLUGINS"

# Core's built-in features, registered as plugins through the same manager as installed ones.
DEFAULT_PLUGINS: tuple[str, ...] = ("runlane.plugins.defaults",)

pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
pm.add_hookspecs(hookspecs)

# The hooks core calls; an implementation of any other name is never called.
HOOK_NAMES: tuple[str, ...] = tuple(
    sorted(name for name, value in vars(hookspecs).items() if hasattr(value, f"{hookspecs.PROJECT_NAME}_spec"))
)


@dataclass(frozen=True, slots=True)
class _Origin:
    distribution: str | None
    version: str | None
    # The runlane releases the distribution declares it works with (``Requires-Dist: runlane...``).
    requires_runlane: str | None = None


@dataclass(frozen=True, slots=True)
class PluginLoadFailure:
    """An entry-point plugin that was skipped because importing or registering it failed."""

    name: str
    distribution: str | None
    error: str


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One registered plugin for ``runlane plugins list``."""

    name: str
    distribution: str | None
    version: str | None
    hooks: tuple[str, ...]
    provides: dict[str, list[str]] = field(default_factory=dict)
    requires_runlane: str | None = None
    """The runlane releases the plugin's distribution declares it works with (``>=0.1,<0.2``), if any."""
    runlane_compatible: bool | None = None
    """Whether the installed runlane is one of them; ``None`` when either is unknown."""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "hooks": list(self.hooks),
            "provides": {kind: list(names) for kind, names in self.provides.items()},
            "requires_runlane": self.requires_runlane,
            "runlane_compatible": self.runlane_compatible,
        }


_origins: dict[str, _Origin] = {}
_failures: list[PluginLoadFailure] = []
_left_out: list[str] = []  # installed entry-point plugins RUNLANE_LOAD_PLUGINS left out
_loaded = False
# Re-entrant: a plugin that a load imports may itself ask for the plugins (``get_registries()`` at import);
# that inner call finds the load under way and returns instead of waiting on its own thread.
_lock = threading.RLock()
# The registries collected from ``pm`` and the plugins they were collected from: each command asks for
# them several times, and a plugin's registration hooks run once for as long as the plugins stay the same.
_collected: tuple[list[tuple[str, Any]], Registries] | None = None


def _runlane_version() -> str | None:
    try:
        return importlib.metadata.version("runlane")
    except importlib.metadata.PackageNotFoundError:
        return None


for _module_name in DEFAULT_PLUGINS:
    pm.register(importlib.import_module(_module_name), name=_module_name)
    _origins[_module_name] = _Origin("runlane", _runlane_version())


def normalize_plugin_name(name: str) -> str:
    """A plugin or distribution name as the allowlist and comparisons see it (``Runlane_Local`` is
    ``runlane-local``)."""
    return name.strip().lower().replace("_", "-").replace(".", "-")


def plugin_allowlist(environ: os._Environ[str] | dict[str, str] | None = None) -> frozenset[str] | None:
    """Normalized names from ``RUNLANE_LOAD_PLUGINS``; ``None`` when unset (load all), empty when set but empty."""
    value = (os.environ if environ is None else environ).get(LOAD_PLUGINS_ENV)
    if value is None:
        return None
    return frozenset(normalize_plugin_name(part) for part in value.split(",") if part.strip())


def runlane_entry_points() -> Iterable[Any]:
    """Installed entry points of the ``runlane`` group."""
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _distribution_of(entry_point: Any) -> _Origin:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return _Origin(None, None)
    name = dist.metadata["Name"] if dist.metadata else getattr(dist, "name", None)
    return _Origin(name, dist.version, _runlane_requirement(getattr(dist, "requires", None) or ()))


def _runlane_requirement(requires: Iterable[str]) -> str | None:
    """The version specifier of the ``runlane`` requirement among a distribution's ``Requires-Dist``
    lines (the one that applies here: not an extra's, its environment marker true), if it has one.

    Every command reads this for each plugin, so the usual line (``runlane>=0.1,<0.2``: no extras,
    marker or URL) is read as a bare specifier set; only other lines take the full requirement
    grammar, whose parser costs more to import than all of this module."""
    for line in requires:
        match = _REQUIREMENT_NAME.match(line)
        if match is None or normalize_plugin_name(match[1]) != "runlane":
            continue
        rest = match[2].strip()
        if any(mark in rest for mark in "[;@"):
            applies, specifier = _requirement_with_grammar(line)
        else:
            applies, specifier = _bare_specifier(rest.removeprefix("(").removesuffix(")"))
        if applies:
            return specifier
    return None


_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(.*)", re.DOTALL)


def _bare_specifier(text: str) -> tuple[bool, str | None]:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        return True, str(SpecifierSet(text.strip())) or None
    except InvalidSpecifier:  # metadata pip would not have installed
        return False, None


def _requirement_with_grammar(line: str) -> tuple[bool, str | None]:
    from packaging.markers import UndefinedEnvironmentName
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            return False, None
    except (InvalidRequirement, UndefinedEnvironmentName):  # metadata pip would not have installed
        return False, None
    return True, str(requirement.specifier) or None


def runlane_compatible(requires_runlane: str | None, installed: str | None = None) -> bool | None:
    """Whether runlane ``installed`` (default: this one) is among the releases ``requires_runlane``
    names (a version specifier such as ``>=0.1,<0.2``); ``None`` when either is unknown."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    installed = installed if installed is not None else _runlane_version()
    if requires_runlane is None or installed is None:
        return None
    try:
        return SpecifierSet(requires_runlane).contains(installed, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def load_entry_point_plugins(
    manager: pluggy.PluginManager,
    entry_points: Iterable[Any],
    *,
    allowlist: frozenset[str] | None = None,
    stderr: IO[str] | None = None,
    left_out: list[str] | None = None,
) -> list[str]:
    """Register each allowed entry point's object on ``manager`` under the entry point's name.

    Already registered names are skipped, so calling this again is harmless; a name already registered
    for another distribution is reported as a failure naming both. A plugin that fails to import or
    register is reported on ``stderr`` (default: ``sys.stderr``) and skipped, and so is an allowlist
    entry that names nothing installed. Hooks of a loaded plugin that no hookspec names are reported.
    The plugins the allowlist leaves out are appended to ``left_out``. Returns the names registered by
    this call.
    """
    registered: list[str] = []
    stream = stderr if stderr is not None else sys.stderr
    known: set[str] = set()
    for entry_point in entry_points:
        name = entry_point.name
        origin = _distribution_of(entry_point)
        known.add(normalize_plugin_name(name))
        if origin.distribution:
            known.add(normalize_plugin_name(origin.distribution))
        if allowlist is not None and not (
            normalize_plugin_name(name) in allowlist
            or (origin.distribution and normalize_plugin_name(origin.distribution) in allowlist)
        ):
            if left_out is not None and name not in left_out:
                left_out.append(name)  # for the hint of a name nothing registered
            continue
        if manager.has_plugin(name):
            holder = _origins.get(name, _Origin(None, None))
            if not _same_distribution(holder.distribution, origin.distribution):
                # pluggy knows a plugin by one name: a second distribution's entry point of that name
                # cannot load, and skipping it silently would hide a plugin the user installed.
                _report_failure(name, origin, entry_point.value, _taken_name(name, holder, origin), stream)
            continue
        try:
            plugin = entry_point.load()
            if inspect.isclass(plugin):
                raise TypeError(
                    f"the entry point names the class {plugin.__name__}; name a module or an instance "
                    f"(plugin = {plugin.__name__}()) instead"
                )
            manager.register(plugin, name=name)
        except (Exception, SystemExit) as error:  # a broken plugin must never take the host down
            described = describe_exception(error)  # one line, as promised
            _report_failure(name, origin, entry_point.value, described, stream)
            continue
        _origins[name] = origin
        registered.append(name)
        _report_unknown_hooks(manager, plugin, name, origin, stream)
        _report_no_hooks(manager, plugin, name, origin, entry_point.value, stream)
        _report_incompatible(name, origin, stream)
    for unknown in sorted((allowlist or frozenset()) - known):
        print(
            f"runlane: {LOAD_PLUGINS_ENV} names {unknown!r}, but no installed plugin or distribution is called "
            "that; `runlane plugins list` shows the installed ones.",
            file=stream,
        )
    return registered


def _same_distribution(first: str | None, second: str | None) -> bool:
    return (first and normalize_plugin_name(first)) == (second and normalize_plugin_name(second))


def _taken_name(name: str, holder: _Origin, origin: _Origin) -> str:
    held_by = f"{holder.distribution}, whose plugin is loaded" if holder.distribution else "a plugin already loaded"
    return (
        f"the entry point {name!r} is also declared by {held_by}; entry-point names must be unique across "
        f"distributions, so this one is not loaded. Uninstall one of the two, or choose one with "
        f"{LOAD_PLUGINS_ENV}=<distribution>"
    )


def _report_failure(name: str, origin: _Origin, value: str, described: str, stream: IO[str]) -> None:
    from_dist = f" from {origin.distribution}" if origin.distribution else ""
    print(f"runlane: skipped plugin {name!r}{from_dist} ({value}): {described}", file=stream)
    _failures.append(PluginLoadFailure(name, origin.distribution, described))


def _unknown_hooks(manager: pluggy.PluginManager, plugin: object) -> list[str]:
    """The hooks ``plugin`` implements that no hookspec of ``manager`` names (a typo, or a newer runlane's)."""
    return sorted(caller.name for caller in manager.get_hookcallers(plugin) or () if not caller.has_spec())


def _report_unknown_hooks(
    manager: pluggy.PluginManager, plugin: object, name: str, origin: _Origin, stream: IO[str]
) -> None:
    """Say which of a loaded plugin's hooks runlane never calls; its other hooks work as usual."""
    from_dist = f" from {origin.distribution}" if origin.distribution else ""
    version = _runlane_version()
    for hook in _unknown_hooks(manager, plugin):
        close = difflib.get_close_matches(hook, HOOK_NAMES, n=1)
        if close:
            meant = f" Did you mean {close[0]!r}?"
        else:
            meant = f" It may be a hook of a newer runlane than {version}." if version else ""
        print(
            f"runlane: plugin {name!r}{from_dist} implements {hook!r}, which is not a runlane hook, so it is "
            f"never called.{meant} The hooks are listed in docs/plugin-hooks.md.",
            file=stream,
        )


def _report_no_hooks(
    manager: pluggy.PluginManager, plugin: object, name: str, origin: _Origin, value: str, stream: IO[str]
) -> None:
    """Say so when a loaded plugin implements no hook at all (its entry point names a function, or its hooks
    lack ``@hookimpl``): it provides nothing, and what it was meant to provide is otherwise only unknown
    where it is used."""
    if manager.get_hookcallers(plugin):
        return
    from_dist = f" from {origin.distribution}" if origin.distribution else ""
    unmarked = [hook for hook in HOOK_NAMES if callable(getattr(plugin, hook, None))]
    if inspect.isroutine(plugin):
        fix = (
            f"its entry point ({value}) names the function {getattr(plugin, '__name__', plugin)!r}; name the module "
            "that holds its hook functions instead"
        )
    elif unmarked:
        fix = f"mark {', '.join(unmarked)} with @hookimpl from runlane.plugins"
    else:
        fix = "mark its hook functions with @hookimpl from runlane.plugins (docs/plugin-hooks.md lists the hooks)"
    print(
        f"runlane: plugin {name!r}{from_dist} implements no runlane hook, so it provides nothing: {fix}.", file=stream
    )


def _report_incompatible(name: str, origin: _Origin, stream: IO[str]) -> None:
    """Say so when the plugin's distribution declares runlane releases this one is not among (runlane
    was upgraded or downgraded past them): it still loads, since the range may be merely cautious, but a
    failure it causes later then has its likely reason on record."""
    if runlane_compatible(origin.requires_runlane) is not False:
        return
    print(
        f"runlane: plugin {name!r} from {origin.distribution} {origin.version} declares it works with "
        f"runlane{origin.requires_runlane}, but runlane {_runlane_version()} is installed; it is loaded and may "
        f"fail. Install a release of {origin.distribution} made for this runlane, or a runlane it supports "
        f"(pip install 'runlane{origin.requires_runlane}').",
        file=stream,
    )


def left_out_plugins() -> list[str]:
    """Installed entry-point plugins that ``RUNLANE_LOAD_PLUGINS`` does not load."""
    return list(_left_out)


def load_plugins() -> None:
    """Load the ``runlane`` entry-point group into ``pm`` once per process; later calls do nothing."""
    global _loaded, _loading_in
    with _lock:
        if _loaded:
            return
        _loaded = True
        _loading_in = threading.get_ident()
        try:
            load_entry_point_plugins(pm, runlane_entry_points(), allowlist=plugin_allowlist(), left_out=_left_out)
        finally:
            _loading_in = None


# The thread importing the entry-point plugins, while it does (``loading_plugins()``).
_loading_in: int | None = None


def loading_plugins() -> bool:
    """Whether this thread is importing the entry-point plugins: a plugin's module is being imported, and
    what depends on every plugin (the ``runlane`` command line) cannot be built yet."""
    return _loading_in == threading.get_ident()


# runlane's own distributions: what their plugins' code raises is runlane's to report (with a traceback).
_FIRST_PARTY_DISTRIBUTIONS = frozenset({"runlane", "runlane-local", "runlane-postgres", "runlane-sqs", "runlane-otlp"})
#: The top-level import packages of those distributions.
FIRST_PARTY_PACKAGES = frozenset(distribution.replace("-", "_") for distribution in _FIRST_PARTY_DISTRIBUTIONS)


def is_first_party(name: str | None) -> bool:
    """Whether the plugin registered as ``name`` comes from one of runlane's own distributions."""
    origin = None if name is None else _origins.get(name)
    distribution = None if origin is None else origin.distribution
    return distribution is not None and normalize_plugin_name(distribution) in _FIRST_PARTY_DISTRIBUTIONS


def get_plugin_failures() -> list[PluginLoadFailure]:
    """Entry-point plugins skipped so far because they failed to import or register."""
    return list(_failures)


def get_registries(manager: pluggy.PluginManager | None = None) -> Registries:
    """Load plugins (for the default manager) and collect everything they register.

    For the default manager the registration hooks run once while the registered plugins stay the
    same; registering or unregistering one collects again.

    For the default manager an installed plugin whose registration fails (a hook that raises, a
    provider with a bad options model) is reported on stderr once, unregistered and skipped, like one
    that fails to import; a name two plugins register fails only where it is used. A failure of core's
    own plugins is raised. A ``manager`` passed in is collected strictly.
    """
    global _collected
    if manager is not None:
        return collect_registries(manager)
    load_plugins()
    with _lock:
        while True:
            plugins = pm.list_name_plugin()
            if _collected is not None and _same_plugins(_collected[0], plugins):
                return _collected[1]
            try:
                registries = collect_registries(pm, keep_collisions=True)
            except RunlaneError as error:
                plugin = (error.meta or {}).get("plugin")
                if not isinstance(plugin, str) or plugin in DEFAULT_PLUGINS or not pm.has_plugin(plugin):
                    raise
                _skip_registered(plugin, error)
                continue
            _collected = (plugins, registries)
            return registries


def _same_plugins(first: list[tuple[str, Any]], second: list[tuple[str, Any]]) -> bool:
    """Whether two ``list_name_plugin()`` readings name the same plugin objects (held by the first, so
    an object id is never reused while it is compared)."""
    return len(first) == len(second) and all(
        name == other_name and plugin is other for (name, plugin), (other_name, other) in zip(first, second)
    )


def skip_plugin(name: str, reason: str) -> None:
    """Report plugin ``name`` as skipped for ``reason`` (stderr, ``get_plugin_failures``) and unregister it."""
    _skip_registered(name, RunlaneError(ErrorCode.CONFIGURATION_INVALID, reason))


def _skip_registered(name: str, error: RunlaneError, stderr: IO[str] | None = None) -> None:
    origin = _origins.get(name, _Origin(None, None))
    from_dist = f" from {origin.distribution}" if origin.distribution else ""
    stream = sys.stderr if stderr is None else stderr
    message = " ".join(error.message.split())  # one line per skipped plugin, whatever the reason says
    print(f"runlane: skipped plugin {name!r}{from_dist}: {message}", file=stream)
    _failures.append(PluginLoadFailure(name, origin.distribution, message))
    pm.unregister(name=name)


def get_plugins(manager: pluggy.PluginManager | None = None) -> list[PluginInfo]:
    """Every registered plugin with its distribution, version, implemented hooks and provided names."""
    if manager is None:
        registries = get_registries()
        manager = pm
    else:
        registries = collect_registries(manager)
    infos = []
    for name, plugin in manager.list_name_plugin():
        if plugin is None:  # blocked
            continue
        origin = _origins.get(name, _Origin(None, None))
        # Only hooks runlane calls: an implementation no hookspec names is never called.
        hooks = tuple(sorted(c.name for c in manager.get_hookcallers(plugin) or () if c.has_spec()))
        infos.append(
            PluginInfo(
                name,
                origin.distribution,
                origin.version,
                hooks,
                registries.provided_by(name),
                origin.requires_runlane,
                runlane_compatible(origin.requires_runlane),
            )
        )
    return sorted(infos, key=lambda info: info.name)
