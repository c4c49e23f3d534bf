"""Summary / suggestion templates: checked when a rule file loads, rendered without failing.

A template is a ``str.format`` string with named placeholders only:

    {value} {baseline} {statistic}          numbers (float; None before the detector has one)
    {onset_step} {fired_step} {step}        steps (int; None while unknown)
    {rule} {metric} {direction}             text
    {labels[layer]}                         one label of the alert (missing label -> "n/a")

Format specs (``{value:.3f}``) and conversions (``{rule!r}``) are allowed. ``check_template``
rejects unknown placeholders, positional ``{}``, attribute access, nested specs and specs that
do not apply to the placeholder's type. ``render_template`` never raises: a None value or a
missing label renders as ``n/a``.

>>> render_template("{rule}: {value:.2f} (baseline {baseline:.2f})",
...                 {"rule": "r", "value": 0.5, "baseline": None})
'r: 0.50 (baseline n/a)'
"""

from __future__ import annotations

import _string  # the parser str.format itself uses
import string
from collections.abc import Mapping
from typing import Any

MISSING = "n/a"

# Placeholder -> an example value of its type, used to check format specs at load time.
PLACEHOLDER_EXAMPLES: dict[str, Any] = {
    "value": 1.5,
    "baseline": 1.5,
    "statistic": 1.5,
    "onset_step": 7,
    "fired_step": 7,
    "step": 7,
    "rule": "rule",
    "metric": "metric",
    "direction": "drop",
}
LABELS_PLACEHOLDER = "labels"
VALID_PLACEHOLDERS = ", ".join([*PLACEHOLDER_EXAMPLES, "labels[...]"])


def check_template(template: str) -> None:
    """Raise ValueError naming the first problem in ``template``."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"invalid template: {e}") from None
    for _, field_name, spec, conversion in parts:
        if field_name is None:
            continue
        if field_name == "" or field_name.isdigit():
            raise ValueError(
                f"positional placeholder '{{{field_name}}}' is not allowed; "
                f"use a name: {VALID_PLACEHOLDERS}"
            )
        first, rest = _string.formatter_field_name_split(field_name)
        accessors = list(rest)
        if first not in PLACEHOLDER_EXAMPLES and first != LABELS_PLACEHOLDER:
            raise ValueError(f"unknown placeholder '{{{field_name}}}'; valid: {VALID_PLACEHOLDERS}")
        if first == LABELS_PLACEHOLDER:
            if len(accessors) != 1 or accessors[0][0]:
                raise ValueError(
                    f"placeholder '{{{field_name}}}' must name one label, like '{{labels[layer]}}'"
                )
            example: Any = "label"
        else:
            if accessors:
                raise ValueError(
                    f"placeholder '{{{field_name}}}' cannot use attributes or indexing"
                )
            example = PLACEHOLDER_EXAMPLES[first]
        if spec and ("{" in spec or "}" in spec):
            raise ValueError(f"placeholder '{{{field_name}}}' has a nested placeholder in its spec")
        if conversion is not None and conversion not in "rsa":
            raise ValueError(
                f"placeholder '{{{field_name}}}' has unknown conversion '!{conversion}'"
            )
        if conversion is not None:
            example = str(example)
        try:
            format(example, spec or "")
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"bad format spec '{spec}' for placeholder '{{{field_name}}}': {e}"
            ) from None


class _LenientFormatter(string.Formatter):
    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        first, rest = _string.formatter_field_name_split(field_name)
        obj = kwargs.get(first) if isinstance(first, str) else None
        for is_attribute, key in rest:
            if is_attribute or not isinstance(obj, Mapping):
                return None, str(first)
            obj = obj.get(str(key))
        return obj, str(first)

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if value is None:
            return None
        return super().convert_field(value, conversion)

    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return MISSING
        try:
            return format(value, format_spec)
        except (ValueError, TypeError):
            return str(value)


_FORMATTER = _LenientFormatter()


def render_template(template: str, values: Mapping[str, Any]) -> str:
    """Fill ``template`` from ``values``; never raises (see the module docstring)."""
    try:
        return _FORMATTER.vformat(template, (), dict(values))
    except Exception:  # a template that slipped past check_template; show it raw
        return template
