"""The error discovery raises and how its messages name modules and the override that fixes them.

Every :class:`DiscoveryError` names the module (``name (ClassName)``, ``<root>`` for the model
itself) and, where an override can fix it, the exact ``DiscoveryOverrides`` spelling.
"""

from __future__ import annotations

from torch import nn


class DiscoveryError(ValueError):
    """Discovery could not find or could not interpret a module; the message says which and
    which override fixes it."""


def join(prefix: str, child: str) -> str:
    """The qualified name of ``child`` under module ``prefix`` ("" is the root)."""
    return f"{prefix}.{child}" if prefix else child


def describe(name: str, module: nn.Module) -> str:
    """``name (ClassName)``, the way messages name a module."""
    return f"{name or '<root>'} ({type(module).__name__})"


def override_hint(name: str, what: str) -> str:
    """The attention override that supplies ``what`` (e.g. ``num_heads/head_dim``) for module
    ``name``."""
    return (
        f"Pass {what} as an override: DiscoveryOverrides(attention={{{name!r}: "
        f"AttentionOverride({what.split('/')[0]}=...)}}) (keys may be fnmatch patterns)"
    )
