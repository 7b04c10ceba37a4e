"""The hook by which a record (a model family, a shard format) comes in without editing the package."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any

from common.errors import UserError


def load_records(modules: Iterable[str], setting: str, attr: str, kind: type, register: Callable[[Any], Any]) -> None:
    """Import each named module (a dotted name importable from ``sys.path``) and ``register`` the ``attr``
    record it defines, an instance of ``kind``; one line naming ``setting`` and the module otherwise."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise UserError(f"{setting}: cannot import {name!r}: {e}") from None
        record = getattr(module, attr, None)
        if not isinstance(record, kind):
            where = f"{kind.__module__}.{kind.__qualname__}"
            raise UserError(f"{setting}: module {name!r} defines no {attr} (a {where} record)")
        register(record)
