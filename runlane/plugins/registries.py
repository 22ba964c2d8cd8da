"""Provider registries: what plugins register, stamped with the plugin that registered it.

This module owns the provider types (``LaneProvider``, ``StorageDriverProvider``, ``TransportProvider``,
``ExporterProvider``), fills registries by calling each registration hook once per plugin with a
``register`` callback, rejects name collisions, and validates a provider's options from ``runlane.toml``.
It never loads entry points (that is ``runlane.plugins.manager``) and never reads configuration files.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar, cast

import pluggy
from pydantic import BaseModel, ValidationError

from ..errors import ErrorCode, RunlaneError, describe_exception, pydantic_message

if typing.TYPE_CHECKING:
    from ..core.lanes import Lane, TransportAdapter
    from ..core.observations import ObservationSink
    from ..storage.driver import StorageDriver

__all__ = [
    "ExporterProvider",
    "LaneProvider",
    "ProviderContext",
    "ProviderRegistry",
    "Registries",
    "StorageDriverProvider",
    "TransportProvider",
    "collect_registries",
    "first_party_hint",
    "registered_by",
    "validate_options",
]


def _invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=meta)


@dataclass(frozen=True, slots=True)
class ProviderContext:
    """What a provider's ``create(options, context)`` may need besides its options.

    ``base_dir`` is the directory relative paths in the configuration resolve against;
    ``registries`` lets a composite provider (a lane built from a storage driver and a transport)
    create its parts by name.
    """

    environment: str = "development"
    base_dir: Path | None = None
    registries: Registries | None = None


# ---------------------------------------------------------------------------------------------
# Providers


@dataclass(frozen=True, slots=True)
class _Provider:
    name: str
    options_model: type[BaseModel]
    create: Callable[[Any, ProviderContext], Any]
    plugin: str | None = field(default=None, compare=False)
    """Name of the plugin that registered this provider; stamped by the registry, not by the plugin."""

    kind: ClassVar[str] = "provider"
    table: ClassVar[str] = "[provider]"


@dataclass(frozen=True, slots=True)
class LaneProvider(_Provider):
    """A lane: ``create(options, context) -> Lane``; selected by ``[lane] use = "<name>"``."""

    create: Callable[[Any, ProviderContext], Lane]

    kind: ClassVar[str] = "lane"
    table: ClassVar[str] = "[lane]"


@dataclass(frozen=True, slots=True)
class StorageDriverProvider(_Provider):
    """A storage driver: ``create(options, context) -> StorageDriver``."""

    create: Callable[[Any, ProviderContext], StorageDriver]

    kind: ClassVar[str] = "storage driver"
    table: ClassVar[str] = "[storage]"


@dataclass(frozen=True, slots=True)
class TransportProvider(_Provider):
    """A wakeup transport: ``create(options, context) -> TransportAdapter``."""

    create: Callable[[Any, ProviderContext], TransportAdapter]

    kind: ClassVar[str] = "transport"
    table: ClassVar[str] = "[transport]"


@dataclass(frozen=True, slots=True)
class ExporterProvider(_Provider):
    """An observation exporter: ``create(options, context) -> ObservationSink``; ``[[exporters]] use = "<name>"``."""

    create: Callable[[Any, ProviderContext], ObservationSink]

    kind: ClassVar[str] = "exporter"
    table: ClassVar[str] = "[[exporters]]"


# Names first-party distributions register, so an unknown name can say what to install. Only names a
# distribution's plugin really registers belong here (runlane-local's lanes build their storage
# themselves and register no storage driver), or the hint sends the user to install what cannot help.
_FIRST_PARTY_HINTS: dict[tuple[str, str], str] = {
    ("lane", "local"): "runlane-local",
    ("lane", "sqlite"): "runlane-local",
    ("lane", "postgres-polling"): "runlane-postgres",
    ("lane", "postgres-sqs"): "runlane-sqs",
    ("transport", "sqs"): "runlane-sqs",
    ("exporter", "otlp"): "runlane-otlp",
    ("exporter", "otlp-traces"): "runlane-otlp",
    ("storage driver", "postgres"): "runlane-postgres",
    ("command", "postgres"): "runlane-postgres",
    ("command", "sqs"): "runlane-sqs",
}


def first_party_hint(kind: str, name: str) -> str:
    """For a ``kind`` (``"lane"``, ``"command"``, ...) named ``name`` that nothing registered: what to
    do when one of runlane's own distributions provides it (install it, or why its plugin did not load),
    with a leading space; ``""`` for any other name."""
    distribution = _FIRST_PARTY_HINTS.get((kind, name))
    return _missing_hint(distribution) if distribution else ""


def _missing_hint(distribution: str) -> str:
    """What to do about a first-party name nothing registered: install its distribution, or, when it
    is installed, why its plugin did not load (skipped, or left out by ``RUNLANE_LOAD_PLUGINS``)."""
    import importlib.metadata

    from .manager import LOAD_PLUGINS_ENV, get_plugin_failures, normalize_plugin_name, plugin_allowlist

    for failure in get_plugin_failures():
        if failure.distribution and normalize_plugin_name(failure.distribution) == distribution:
            why = failure.error.rstrip(".")
            return f" {distribution} is installed, but its plugin {failure.name!r} was skipped: {why}."
    if plugin_allowlist() is not None:
        try:
            importlib.metadata.distribution(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            listed = os.environ.get(LOAD_PLUGINS_ENV, "")
            return (
                f" {distribution} is installed, but {LOAD_PLUGINS_ENV}={listed!r} does not load it; "
                f"add {distribution} there."
            )
    return f" Install {distribution} to get it."


def _left_out_hint() -> str:
    """For a name no loaded plugin registered: the installed plugins ``RUNLANE_LOAD_PLUGINS`` leaves out."""
    from .manager import LOAD_PLUGINS_ENV, left_out_plugins

    left_out = left_out_plugins()
    if not left_out:
        return ""
    listed = os.environ.get(LOAD_PLUGINS_ENV, "")
    return (
        f" {LOAD_PLUGINS_ENV}={listed!r} leaves out the installed plugins {', '.join(map(repr, left_out))}; "
        "add the one that provides it."
    )


def _skipped_hint() -> str:
    """For a name no loaded plugin registered: the installed plugins that were skipped, one of which may be
    the one that provides it (a plugin is skipped whole when any of its hooks fails)."""
    from .manager import get_plugin_failures

    skipped = list(dict.fromkeys(failure.name for failure in get_plugin_failures()))
    if not skipped:
        return ""
    why = "`runlane plugins list` says why"
    if len(skipped) == 1:
        return f" Plugin {skipped[0]!r} was skipped, and it may be the one that provides it: {why}."
    return f" Plugins {', '.join(map(repr, skipped))} were skipped, and one of them may provide it: {why}."


P = TypeVar("P", bound=_Provider)


class ProviderRegistry(Generic[P]):
    """Providers of one kind by name, each stamped with the plugin that registered it."""

    def __init__(self, provider_type: type[P], *, keep_collisions: bool = False) -> None:
        self.provider_type = provider_type
        self._providers: dict[str, P] = {}
        # With ``keep_collisions``, a name two plugins register is kept as ambiguous: ``get()`` of it
        # fails naming both, and every other name still works.
        self._keep_collisions = keep_collisions
        self._collisions: dict[str, list[str]] = {}

    @property
    def kind(self) -> str:
        return self.provider_type.kind

    def add(self, provider: object, *, plugin: str) -> P:
        """Store ``provider`` under its name for ``plugin``; reject wrong types, bad models and collisions."""
        if not isinstance(provider, self.provider_type):
            raise _invalid(
                f"Plugin {plugin!r} registered {provider!r} as {_a(self.kind)}; "
                f"pass {_a(self.provider_type.__name__)}(name, options_model, create).",
                plugin=plugin,
            )
        if not isinstance(provider.name, str) or not provider.name:
            raise _invalid(f"Plugin {plugin!r} registered a {self.kind} without a name.", plugin=plugin)
        _check_options_model(provider, plugin)
        if not callable(provider.create):
            raise _invalid(
                f"Plugin {plugin!r} registered {self.kind} {provider.name!r} whose create is not callable.",
                plugin=plugin,
            )
        existing = self._providers.get(provider.name)
        stamped = dataclasses.replace(provider, plugin=plugin)
        if existing is not None:
            # Every provider in ``_providers`` was stamped with its plugin above.
            plugins = self._collisions.setdefault(provider.name, [cast(str, existing.plugin)])
            plugins.append(plugin)
            if not self._keep_collisions:
                raise self._collision(provider.name)
            return stamped
        self._providers[provider.name] = stamped
        return stamped

    def _collision(self, name: str) -> RunlaneError:
        plugins = self._collisions[name]
        if len(set(plugins)) == 1:  # one plugin's own mistake: nothing to uninstall or leave out
            advice = "report it to the plugin's authors"
        else:
            advice = "uninstall one of them or limit plugins with RUNLANE_LOAD_PLUGINS"
        return _invalid(
            f"The {self.kind} {name!r} is {registered_by(plugins)}; {advice}.",
            kind=self.kind,
            name=name,
            plugins=list(plugins),
        )

    @property
    def collisions(self) -> dict[str, list[str]]:
        """Names more than one plugin registered, with those plugins (kept only with ``keep_collisions``)."""
        return {name: list(plugins) for name, plugins in self._collisions.items()}

    def get(self, name: str) -> P:
        """The provider registered as ``name``; an unknown name lists the installed ones, and a name two
        plugins registered names both."""
        if name in self._collisions:
            raise self._collision(name)
        provider = self._providers.get(name)
        if provider is not None:
            return provider
        installed = ", ".join(f"{n} (plugin {p.plugin})" for n, p in sorted(self._providers.items())) or "none"
        install = first_party_hint(self.kind, name) or _left_out_hint() + _skipped_hint()
        raise _invalid(
            f"Unknown {self.kind} {name!r}; installed {self.kind}s: {installed}.{install}",
            kind=self.kind,
            name=name,
            installed=sorted(self._providers),
        )

    def names(self) -> list[str]:
        return sorted(self._providers)

    def by_plugin(self, plugin: str) -> list[str]:
        return sorted(
            {n for n, p in self._providers.items() if p.plugin == plugin}
            | {n for n, plugins in self._collisions.items() if plugin in plugins}
        )

    def __contains__(self, name: object) -> bool:
        return name in self._providers

    def __iter__(self) -> Iterator[P]:
        return iter(self._providers[name] for name in sorted(self._providers))

    def __len__(self) -> int:
        return len(self._providers)


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "a lane", "an exporter", "an ExporterProvider"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def registered_by(plugins: Sequence[str]) -> str:
    """Who registered a name more than once: "registered by plugin 'a' and plugin 'b'", or "registered
    twice by plugin 'a'" when it is one plugin's doing."""
    distinct = list(dict.fromkeys(plugins))
    if len(distinct) == 1:
        times = {2: "twice", 3: "three times"}.get(len(plugins), f"{len(plugins)} times")
        return f"registered {times} by plugin {distinct[0]!r}"
    return f"registered by {' and '.join(f'plugin {plugin!r}' for plugin in distinct)}"


def _check_options_model(provider: _Provider, plugin: str) -> None:
    model = provider.options_model
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise _invalid(
            f"Plugin {plugin!r} registered {provider.kind} {provider.name!r} whose options_model is not a pydantic model.",
            plugin=plugin,
        )
    if model.model_config.get("extra") != "forbid":
        raise _invalid(
            f"Plugin {plugin!r} registered {provider.kind} {provider.name!r} whose options model "
            f"{model.__name__} allows unknown keys; set model_config = ConfigDict(extra='forbid').",
            plugin=plugin,
        )


@dataclass(frozen=True, slots=True)
class Contribution:
    """A task module or observer, with the plugin that contributed it."""

    value: Any
    plugin: str


@dataclass(frozen=True, slots=True)
class PluginObserver:
    """A plugin's observer as a runtime calls it: its failures name the plugin (see ``Registries.plugin_observers``)."""

    observer: Callable[[Any], Any]
    plugin: str

    def __call__(self, observation: Any) -> Any:
        return self.observer(observation)

    def __repr__(self) -> str:
        return f"{_observer_name(self.observer)} of plugin {self.plugin!r}"

    @property
    def failure_hint(self) -> str:
        return f"Report it to the authors of plugin {self.plugin!r}, or leave the plugin out with RUNLANE_LOAD_PLUGINS."


@dataclass(slots=True)
class Registries:
    """Everything the installed plugins register, collected by ``collect_registries()``."""

    lanes: ProviderRegistry[LaneProvider] = field(default_factory=lambda: ProviderRegistry(LaneProvider))
    storage_drivers: ProviderRegistry[StorageDriverProvider] = field(
        default_factory=lambda: ProviderRegistry(StorageDriverProvider)
    )
    transports: ProviderRegistry[TransportProvider] = field(
        default_factory=lambda: ProviderRegistry(TransportProvider)
    )
    exporters: ProviderRegistry[ExporterProvider] = field(default_factory=lambda: ProviderRegistry(ExporterProvider))
    task_modules: list[Contribution] = field(default_factory=list)
    observers: list[Contribution] = field(default_factory=list)

    def plugin_observers(self) -> list[PluginObserver]:
        """Every registered observer, wrapped so that its failures name its plugin."""
        return [PluginObserver(c.value, c.plugin) for c in self.observers]

    def provided_by(self, plugin: str) -> dict[str, list[str]]:
        """What ``plugin`` registered, by hook-facing kind; kinds it registered nothing for are left out."""
        provided = {
            "lanes": self.lanes.by_plugin(plugin),
            "storage_drivers": self.storage_drivers.by_plugin(plugin),
            "transports": self.transports.by_plugin(plugin),
            "exporters": self.exporters.by_plugin(plugin),
            "task_modules": [c.value for c in self.task_modules if c.plugin == plugin],
            "observers": [_observer_name(c.value) for c in self.observers if c.plugin == plugin],
        }
        return {kind: names for kind, names in provided.items() if names}


def _observer_name(observer: Any) -> str:
    return getattr(observer, "__qualname__", None) or type(observer).__qualname__


# ---------------------------------------------------------------------------------------------
# Collection


def collect_registries(manager: pluggy.PluginManager, *, keep_collisions: bool = False) -> Registries:
    """Call every registration hook of ``manager`` once per plugin and return the filled registries.

    Each plugin gets its own ``register`` callback, so every entry records which plugin provided it.
    A wrong provider type or a failing hook raises ``configuration_invalid`` naming the plugin (in
    ``meta["plugin"]``). So does a name two plugins register, unless ``keep_collisions``: then the name
    is ambiguous (looking it up fails naming both plugins) and everything else is usable.
    """
    registries = Registries(
        lanes=ProviderRegistry(LaneProvider, keep_collisions=keep_collisions),
        storage_drivers=ProviderRegistry(StorageDriverProvider, keep_collisions=keep_collisions),
        transports=ProviderRegistry(TransportProvider, keep_collisions=keep_collisions),
        exporters=ProviderRegistry(ExporterProvider, keep_collisions=keep_collisions),
    )
    provider_hooks: tuple[tuple[str, ProviderRegistry[Any]], ...] = (
        ("register_lanes", registries.lanes),
        ("register_storage_drivers", registries.storage_drivers),
        ("register_transports", registries.transports),
        ("register_exporters", registries.exporters),
    )
    for hook_name, registry in provider_hooks:
        _call_per_plugin(manager, hook_name, functools.partial(_provider_adder, registry))
    _call_per_plugin(manager, "register_task_modules", lambda plugin: _module_adder(registries, plugin))
    _call_per_plugin(manager, "register_observers", lambda plugin: _observer_adder(registries, plugin))
    return registries


def _provider_adder(registry: ProviderRegistry[Any], plugin: str) -> Callable[[Any], Any]:
    return lambda provider: registry.add(provider, plugin=plugin)


def _module_adder(registries: Registries, plugin: str) -> Callable[[str], None]:
    def register(module: str) -> None:
        if not isinstance(module, str) or not module or any(not part.isidentifier() for part in module.split(".")):
            raise _invalid(
                f"Plugin {plugin!r} registered task module {module!r}; pass a dotted module name such as 'package.tasks'.",
                plugin=plugin,
            )
        if all(c.value != module for c in registries.task_modules):
            registries.task_modules.append(Contribution(module, plugin))

    return register


def _observer_adder(registries: Registries, plugin: str) -> Callable[[Any], None]:
    def register(observer: Any) -> None:
        if not callable(observer):
            raise _invalid(
                f"Plugin {plugin!r} registered observer {observer!r}; pass a callable observer(observation).",
                plugin=plugin,
            )
        registries.observers.append(Contribution(observer, plugin))

    return register


def _call_per_plugin(
    manager: pluggy.PluginManager, hook_name: str, make_register: Callable[[str], Callable[[Any], Any]]
) -> None:
    hook = getattr(manager.hook, hook_name)
    # pluggy calls the last registered implementation first; keep its order.
    for impl in reversed(hook.get_hookimpls()):
        register = make_register(impl.plugin_name)
        arguments = {"register": register}
        try:
            returned = impl.function(*(arguments[name] for name in impl.argnames))
        except RunlaneError:
            raise
        # sys.exit() in a plugin's hook must skip that plugin, not end runlane (``runlane --version``
        # included) silently with the plugin's exit status.
        except (Exception, SystemExit) as error:
            raise _invalid(
                f"Plugin {impl.plugin_name!r} failed in {hook_name}: {describe_exception(error)}",
                plugin=impl.plugin_name,
                hook=hook_name,
            ) from error
        if returned is not None:
            raise _invalid(
                f"Plugin {impl.plugin_name!r}: its {hook_name} returned {type(returned).__name__}, which runlane "
                "ignores; call register(provider) once per provider instead of returning them.",
                plugin=impl.plugin_name,
                hook=hook_name,
            )


# ---------------------------------------------------------------------------------------------
# Options


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The options model an annotation holds: itself, or inside ``X | None`` / ``dict[str, X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = _model_in(argument)
        if found is not None:
            return found
    return None


def _fields_at(model: type[BaseModel], loc: Sequence[Any]) -> list[str] | None:
    """The keys a nested table at ``loc`` accepts (``None`` when ``loc`` leads to no options model)."""
    current: type[BaseModel] | None = model
    pending_mapping_key = False
    for part in loc:
        if current is None:
            return None
        if pending_mapping_key:  # the user's key in a dict[str, Model] table
            pending_mapping_key = False
            continue
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        pending_mapping_key = typing.get_origin(field.annotation) is dict
        current = _model_in(field.annotation)
    return None if current is None or pending_mapping_key else list(current.model_fields)


def validate_options(provider: _Provider, options: Mapping[str, Any], *, table: str | None = None) -> BaseModel:
    """Validate ``options`` (the table's keys without ``use``) with the provider's options model.

    Any pydantic error becomes ``configuration_invalid`` naming each offending key, the table
    (``table`` or the provider kind's default, such as ``[lane]``) and the plugin. So does any other
    exception a validator of the plugin's model raises (pydantic passes on all but ``ValueError`` and
    ``AssertionError``), and ``sys.exit()`` in one: a plugin's mistake, never a traceback.
    """
    where = table or provider.table
    try:
        return provider.options_model.model_validate(dict(options))
    except ValidationError as error:
        problems = []
        keys = []
        for detail in error.errors():
            key = ".".join(str(part) for part in detail["loc"]) or "(table)"
            keys.append(key)
            if detail["type"] == "extra_forbidden":
                nested = _fields_at(provider.options_model, detail["loc"][:-1]) if len(detail["loc"]) > 1 else None
                there = f" (allowed there: {', '.join(sorted(nested))})" if nested else ""
                problems.append(f"unknown key {key!r}{there}")
            else:
                message = pydantic_message(detail)
                problems.append(f"key {key!r}: {message}" if detail["loc"] else message)
        allowed = ", ".join(sorted(provider.options_model.model_fields)) or "none"
        raise _invalid(
            f"Invalid options in {where} for {provider.kind} {provider.name!r} (plugin {provider.plugin!r}): "
            f"{'; '.join(problems)}. Allowed keys: {allowed}.",
            table=where,
            keys=keys,
            provider=provider.name,
            plugin=provider.plugin,
        ) from None
    except RunlaneError:
        raise
    except (Exception, SystemExit) as error:
        raise _invalid(
            f"Invalid options in {where} for {provider.kind} {provider.name!r} (plugin {provider.plugin!r}): "
            f"its options model {provider.options_model.__name__} raised {describe_exception(error)}. "
            "Check the options, or report it to the plugin's authors.",
            table=where,
            provider=provider.name,
            plugin=provider.plugin,
        ) from error
