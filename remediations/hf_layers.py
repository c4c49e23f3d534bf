"""Which modules of a model compute attention, and how: read from their classes' source.

transformers attention layers fetch their attention function with
``ALL_ATTENTION_FUNCTIONS.get_interface(...)`` (transformers itself decides whether a model can
switch implementation by searching its source for that call). This module does the same, per
module class (and its bases), so that ``install_hf_attention`` can tell the layers that consult
the interface from attention-like layers that do not: those calling torch's
``scaled_dot_product_attention`` themselves (Falcon), linear attention and state-space mixers
(Qwen3-Next's gated DeltaNet, Kimi's delta attention, Jamba's Mamba), and anything else named
like attention. ``interface_keywords`` lists the keyword arguments a class passes to its
attention function (``s_aux``, ``softcap``, ``position_bias``, ...).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field

from torch import nn

_ATTENTION_LIKE = re.compile(r"attention|attn|deltanet|mamba|retention|rwkv|linearmixer", re.I)
_LINEAR_LIKE = re.compile(r"linear|delta|mamba|retention|rwkv|ssm|lightning", re.I)
_CONSULTS = ("get_interface(", "ALL_ATTENTION_FUNCTIONS[")
_TORCH_SDPA = "scaled_dot_product_attention("


@dataclass
class AttentionModules:
    """A model's attention modules: those that consult the interface, and the others."""

    consulting: list[tuple[str, nn.Module]] = field(default_factory=list)
    unread: list[tuple[str, nn.Module, str]] = field(default_factory=list)  # (name, module, why)

    def describe_unread(self) -> str:
        """One entry per class: ``Class x N (first name, ...): why``."""
        groups: dict[tuple[str, str], list[str]] = defaultdict(list)
        for name, module, why in self.unread:
            groups[(type(module).__name__, why)].append(name or "<root>")
        parts = []
        for (cls, why), names in groups.items():
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            parts.append(f"{cls} x{len(names)} ({shown}): {why}")
        return "; ".join(parts) if parts else "no attention-like module found"

    def calling_torch_sdpa(self) -> list[str]:
        """Names of the modules that call torch's scaled_dot_product_attention themselves."""
        return [name for name, _, why in self.unread if why == CALLS_TORCH_SDPA]

    def redirect_hint(self) -> str:
        if not self.calling_torch_sdpa():
            return ""
        return (
            " Layers that call torch's scaled_dot_product_attention themselves can consult the "
            "switch through remediations.sdpa_redirect.install_sdpa_redirect(model)."
        )


CALLS_TORCH_SDPA = "calls torch's scaled_dot_product_attention itself"
LINEAR_ATTENTION = "linear attention or a state-space mixer (no softmax attention to switch)"
OWN_ATTENTION = "computes attention without the attention interface"


def attention_modules(model: nn.Module) -> AttentionModules:
    """Sort ``model``'s modules into interface-consulting attention and attention-like others
    (not counting containers of consulting modules, nor modules inside them)."""
    modules = dict(model.named_modules())
    consulting = [(n, m) for n, m in modules.items() if consults_interface(type(m))]
    prefixes = [n for n, _ in consulting]
    found = AttentionModules(consulting=consulting)
    for name, module in modules.items():
        if any(_related(name, p) for p in prefixes):
            continue
        why = _unread_reason(type(module))
        if why is not None:
            found.unread.append((name, module, why))
    # A decoder layer named like its mixer (JambaMambaDecoderLayer) is not a second finding.
    names = [name for name, _, _ in found.unread]
    found.unread = [
        entry
        for entry in found.unread
        if not any(other.startswith(entry[0] + ".") for other in names if entry[0])
    ]
    return found


def _related(name: str, other: str) -> bool:
    """``name`` is ``other``, contains it or sits inside it (the root contains everything)."""
    if not name or not other:
        return True
    return name == other or name.startswith(other + ".") or other.startswith(name + ".")


def _unread_reason(cls: type) -> str | None:
    if cls is nn.MultiheadAttention:
        return OWN_ATTENTION + " (torch.nn.MultiheadAttention)"
    if not _ATTENTION_LIKE.search(cls.__name__):
        return None
    source = class_source(cls)
    if _TORCH_SDPA in source:
        return CALLS_TORCH_SDPA
    if _LINEAR_LIKE.search(cls.__name__):
        return LINEAR_ATTENTION
    if not _has_projections(cls, source):
        return None  # a norm, a rotary embedding, a mask helper named like attention
    return OWN_ATTENTION


def _has_projections(cls: type, source: str) -> bool:
    return "nn.Linear" in source or "Conv1D" in source or "_proj" in source


@functools.cache
def class_source(cls: type) -> str:
    """The source of ``cls`` and of its bases outside torch (empty when unavailable)."""
    parts = []
    for klass in cls.__mro__:
        if klass is object or klass.__module__.startswith("torch"):
            continue
        try:
            parts.append(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
    return "\n".join(parts)


def consults_interface(cls: type) -> bool:
    """Whether ``cls`` (or a base) fetches its attention function from the interface."""
    if not issubclass(cls, nn.Module) or cls.__module__.startswith("torch"):
        return False
    if any(k.__name__ == "PreTrainedModel" for k in cls.__mro__):
        return False  # a whole model (its base class reads the interface to set it up)
    source = class_source(cls)
    return any(marker in source for marker in _CONSULTS)


@functools.cache
def interface_keywords(cls: type) -> frozenset[str]:
    """Keyword names ``cls`` passes to the function it got from ``get_interface``."""
    source = class_source(cls)
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(tree):
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_get_interface(value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    keywords: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            keywords |= {k.arg for k in node.keywords if k.arg is not None}
    return frozenset(keywords)


def _is_get_interface(value: object) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr == "get_interface"
    )
