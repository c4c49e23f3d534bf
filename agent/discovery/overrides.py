"""Explicit answers for what discovery cannot infer, and how they are matched to modules.

:class:`DiscoveryOverrides` is meant to be filled from the agent's YAML config (unknown keys
are errors). Keys are module names as in ``model.named_modules()`` or fnmatch patterns (``*``
also crosses dots); an exact name wins over patterns, else the first matching pattern applies.
:func:`scan_model` is the one walk over a model that both ``find_attention`` and
``find_routers`` start with: it rejects override keys that name no module (with close matches)
or an excluded one, and pairs each remaining module with its override.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from agent.discovery.errors import DiscoveryError

QKVLayout = Literal["concat", "per_head", "grouped"]
_O = TypeVar("_O")


class AttentionOverride(BaseModel):
    """What discovery cannot infer about one attention module (or each module a pattern
    matches). Unset fields are inferred as usual."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q: str | None = Field(None, description="child module holding the query projection")
    k: str | None = Field(None, description="child module holding the key projection")
    qkv: str | None = Field(None, description="child module holding a fused QKV projection")
    qkv_layout: QKVLayout | None = Field(
        None,
        description="row layout of the fused projection: 'concat' (all q, all k, all v), "
        "'per_head' ([q_h, k_h, v_h] per head, GPT-NeoX/Bloom), 'grouped' (per KV group: its "
        "query heads, then k, then v; Falcon-40B)",
    )
    num_heads: int | None = Field(None, ge=1, description="number of query heads H")
    num_kv_heads: int | None = Field(None, ge=1, description="number of key/value heads H_kv")
    head_dim: int | None = Field(None, ge=1, description="per-head dimension d_h")
    q_norm: str | None = Field(None, description="child module of the query QK-norm")
    k_norm: str | None = Field(None, description="child module of the key QK-norm")
    fold_qk_norm: bool = Field(True, description="fold QK-norm scales into the factors")

    @model_validator(mode="after")
    def _one_projection_form(self) -> AttentionOverride:
        if self.qkv is not None and (self.q is not None or self.k is not None):
            raise ValueError("set either q and k, or qkv, not both")
        if (self.q is None) != (self.k is None):
            raise ValueError("q and k must be set together")
        return self


class RouterOverride(BaseModel):
    """Marks a module as a router (it must hold a ``weight`` of shape [E, d])."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_experts: int | None = Field(None, ge=2, description="E; must equal weight.shape[0]")
    top_k: int | None = Field(None, ge=1, description="experts chosen per token")


class DiscoveryOverrides(BaseModel):
    """Explicit answers for what discovery cannot infer. Keys are module names as in
    ``model.named_modules()``, or fnmatch patterns (``*`` also crosses dots); an exact name
    wins over patterns, else the first matching pattern applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: dict[str, AttentionOverride] = Field(
        default_factory=dict, description="attention module name or pattern -> override"
    )
    routers: dict[str, RouterOverride] = Field(
        default_factory=dict, description="router module name or pattern -> override"
    )
    exclude: list[str] = Field(
        default_factory=list, description="fnmatch patterns of module names to ignore"
    )


@dataclass(frozen=True)
class ModelScan(Generic[_O]):
    """A model's modules with one kind of override (attention or routers) checked against them."""

    modules: dict[str, nn.Module]  # named_modules(), in order
    param_names: dict[int, str]  # id(parameter) -> qualified name, as in named_parameters()
    table: Mapping[str, _O]  # module name or pattern -> override
    exclude: Sequence[str]  # fnmatch patterns of module names to ignore

    def candidates(self) -> Iterator[tuple[str, nn.Module, _O | None]]:
        """``(name, module, override or None)`` for every module not excluded, in order."""
        for name, module in self.modules.items():
            if not _excluded(name, self.exclude):
                yield name, module, _override_for(name, self.table)


def scan_model(
    caller: str, model: nn.Module, kind: str, table: Mapping[str, _O], exclude: Sequence[str]
) -> ModelScan[_O]:
    """Index ``model`` for ``caller`` (a public function's name, for the type error) and check
    the ``kind`` override keys of ``table``; raises :class:`DiscoveryError` on a bad key."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller} expects an nn.Module, got {type(model).__name__}")
    modules = dict(model.named_modules())
    _check_override_keys(kind, table, modules, exclude)
    param_names = {id(p): n for n, p in model.named_parameters()}
    return ModelScan(modules, param_names, table, exclude)


def _is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def _override_for(name: str, table: Mapping[str, _O]) -> _O | None:
    if name in table:
        return table[name]
    for key, value in table.items():
        if _is_pattern(key) and fnmatchcase(name, key):
            return value
    return None


def _check_override_keys(
    kind: str,
    table: Mapping[str, object],
    modules: Mapping[str, nn.Module],
    exclude: Sequence[str],
) -> None:
    for key in table:
        if _is_pattern(key):
            if not any(fnmatchcase(name, key) for name in modules):
                raise DiscoveryError(
                    f"discovery override {kind}[{key!r}]: the pattern matches no module"
                )
        elif key not in modules:
            close = difflib.get_close_matches(key, list(modules), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise DiscoveryError(
                f"discovery override {kind}[{key!r}]: no module of that name in the model{hint}"
            )
        elif _excluded(key, exclude):
            raise DiscoveryError(
                f"discovery override {kind}[{key!r}]: the module is also matched by `exclude`"
            )
