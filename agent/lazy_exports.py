"""Lazy package exports (PEP 562): a package's public names, each imported from its submodule
the first time it is accessed, so that importing the package itself stays cheap and free of
import cycles.

In a package's ``__init__.py``::

    __all__, __getattr__ = lazy_exports(__name__, {"Notifier": ".base", "Outbox": ".outbox"})

A module path that starts with ``.`` is relative to the package. An unknown name raises
``AttributeError`` as a plain module would.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[list[str], Callable[[str], Any]]:
    """``__all__`` (the sorted public names) and the module ``__getattr__`` for ``package``,
    whose ``exports`` map each public name to the module that defines it."""
    table = dict(exports)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return sorted(table), __getattr__
