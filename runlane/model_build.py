"""Building models from values that are already valid, without running validation again.

The write paths build a handful of small models per run (leases, lifecycle events, event records)
from parts that were validated when they were made: ids from stored runs or validated options, UTC
datetimes from the storage transaction, JSON values that passed ``ensure_json_value``. Validating
them again costs more than the rest of building the event. ``build_validated`` builds the instance
the way pydantic's own ``model_construct`` does (same ``__dict__``, field order and set fields) but
without its per-field default handling; callers use it only where every value is proven valid and
fall back to the validating constructor otherwise. The tests compare both constructions field by
field and by their JSON text.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

from pydantic import BaseModel

from .models import Actor
from .vocabulary import ActorType

__all__ = ["build_validated", "worker_actor"]

M = TypeVar("M", bound=BaseModel)

_set = object.__setattr__
_REQUIRED = object()


class _Plan:
    __slots__ = ("defaults", "direct")

    def __init__(self, model: type[BaseModel]) -> None:
        # Building directly stays equivalent only while the model has no private attributes, no
        # post-init hook, no extra fields and no default factories (their defaults are per instance).
        fields = model.model_fields
        self.direct = (
            not model.__private_attributes__
            and model.__pydantic_post_init__ is None
            and model.model_config.get("extra") != "allow"
            and all(field.default_factory is None for field in fields.values())
        )
        self.defaults = {name: _REQUIRED if field.is_required() else field.default for name, field in fields.items()}


@functools.cache
def _plan(model: type[BaseModel]) -> _Plan:
    return _Plan(model)


_PLANS: dict[type[BaseModel], _Plan] = {}  # ``_plan`` without the call, on the hot path


def build_validated(model: type[M], values: dict[str, Any]) -> M:
    """``model(**values)`` for values that are already valid field values (every required field given).

    The result equals the validated construction: defaults fill the fields not given, and the
    fields given are the instance's set fields.
    """
    plan = _PLANS.get(model)
    if plan is None:
        plan = _plan(model)
        _PLANS[model] = plan
    if not plan.direct:
        return model.model_construct(**values)
    data = {**plan.defaults, **values}
    instance = object.__new__(model)
    _set(instance, "__dict__", data)
    _set(instance, "__pydantic_fields_set__", set(values))
    _set(instance, "__pydantic_extra__", None)
    _set(instance, "__pydantic_private__", None)
    return instance


@functools.lru_cache(maxsize=1024)
def worker_actor(worker_id: str) -> Actor:
    """The (immutable, shared) worker actor of ``worker_id``; validated once per worker id."""
    return Actor(type=ActorType.WORKER, id=worker_id)
