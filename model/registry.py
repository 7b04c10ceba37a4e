"""Model families and named model sizes: one registry of the ``Family`` records (``model.family``).

Everything that differs between families lives in its record, defined by the family's own module beside its
spec and model: code elsewhere asks ``family_of(spec)`` instead of comparing family names. The registry
imports the built-in families (``model.bert``, ``model.neox``); another comes in without editing this package,
through :func:`load_families`: ``model.families`` (``training.config``) names Python modules, each defining a
``FAMILY`` record whose ``sizes`` join ``REGISTRY``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from common.errors import UserError
from common.plugins import load_records
from model import bert, neox
from model.family import Family

__all__ = [
    "FAMILIES",
    "REGISTRY",
    "Family",
    "ModelSpec",
    "family_of",
    "get_spec",
    "with_fields",
    "load_families",
    "register",
    "spec_from_dict",
    "spec_to_dict",
]

ModelSpec = Any
"""A spec of any registered family (a frozen dataclass, ``model.family``): ``BertSpec``, ``NeoxSpec``, ..."""

FAMILIES: dict[str, Family] = {}
REGISTRY: dict[str, ModelSpec] = {}


def register(family: Family) -> None:
    """Add a family and its sizes. Registering the same record again does nothing; another record under a
    registered family or size name is refused."""
    if FAMILIES.get(family.name) is family:
        return
    if family.name in FAMILIES:
        raise UserError(f"model family {family.name!r} is already registered")
    taken = sorted(s.name for s in family.sizes if s.name in REGISTRY)
    if taken:
        raise UserError(f"model family {family.name!r}: size(s) {', '.join(taken)} already registered")
    for spec in family.sizes:
        if spec.family != family.name or type(spec) is not family.spec_class:
            raise UserError(f"model family {family.name!r}: size {spec.name!r} is not a {family.spec_class.__name__}")
    FAMILIES[family.name] = family
    REGISTRY.update((s.name, s) for s in family.sizes)


for _builtin in (bert.FAMILY, neox.FAMILY):
    register(_builtin)


def load_families(modules: Iterable[str]) -> None:
    """The hook by which a family comes in without editing this package: import each named module (a dotted
    name importable from ``sys.path``; a run's working directory is on it) and register its ``FAMILY``
    record. ``model.families`` names them for a run; loading the config calls this."""
    load_records(modules, "model.families", "FAMILY", Family, register)


def get_spec(name: str, **overrides: Any) -> ModelSpec:
    """The named size, optionally with fields replaced (e.g. ``vocab_size`` from the data's vocabulary)."""
    try:
        spec = REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown model {name!r}; known models: {', '.join(REGISTRY)}") from None
    return with_fields(spec, name, **overrides)


def with_fields(spec: ModelSpec, name: str, **overrides: Any) -> ModelSpec:
    """``spec`` (the size ``name``) with the fields given (not None) replaced, checked by its family's spec."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return spec
    fields = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(f"model {name!r} has no field(s) {', '.join(unknown)}")
    try:
        return dataclasses.replace(spec, **overrides)
    except ValueError as e:
        raise UserError(str(e)) from None


def spec_to_dict(spec: ModelSpec) -> dict:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict) -> ModelSpec:
    """Rebuild a spec stored in a checkpoint or summary (the derived ``padded_vocab`` is ignored)."""
    try:
        family = FAMILIES[d["family"]]
    except KeyError:
        raise UserError(f"model spec has family {d.get('family')!r}; known families: {', '.join(FAMILIES)}") from None
    fields = {f.name for f in dataclasses.fields(family.spec_class)}
    derived = {"padded_vocab"}
    unknown = sorted(set(d) - fields - derived)
    if unknown:
        raise UserError(f"model spec {d.get('name')!r} has unknown field(s) {', '.join(unknown)}")
    try:
        return family.spec_class(**{k: v for k, v in d.items() if k in fields})
    except (TypeError, ValueError) as e:
        raise UserError(f"model spec {d.get('name')!r}: {e}") from None


def family_of(spec: ModelSpec) -> Family:
    """The family record of a spec."""
    try:
        return FAMILIES[spec.family]
    except KeyError:
        raise UserError(f"model {spec.name!r} has unknown family {spec.family!r}") from None
