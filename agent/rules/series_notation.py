"""The input notation of rule unit tests (``mechwatch test``), as promtool's.

A series names a metric and its labels, ``metric{label="value", ...}`` (``metric`` alone when
it has none; values in double or single quotes, with ``\\"``, ``\\'``, ``\\\\`` and ``\\n``
escapes). Its values are space-separated tokens in promtool's expanding notation, the first
at step 0 and one every ``interval`` steps:

    a        one value: 1, -2.5, 1e-4, .5, inf, -inf, nan (any case)
    a+bxn    n+1 values a, a+b, a+2b, ..., a+nb        ('1+2x3' is '1 3 5 7')
    a-bxn    n+1 values a, a-b, ..., a-nb              ('1-0.25x2' is '1 0.75 0.5')
    axn      n+1 copies of a (a+0xn)                   ('0.9x2' is '0.9 0.9 0.9')
    _        a missing value: no sample at that step
    _xn      n missing values (as in promtool: a missing value cannot grow, so n, not n+1)

Each value of ``a+bxn`` is computed as ``a + i*b`` (no accumulated rounding). Errors are
``NotationError`` with the offset of the offending character in the text, so that a caller
can point at the column in the file.

>>> expand_values("1+2x3 _ 0.5x1 _x2 4")
[1.0, 3.0, 5.0, 7.0, None, 0.5, 0.5, None, None, 4.0]
>>> parse_series('router_entropy_norm{router="blocks.0.moe.gate"}')
('router_entropy_norm', (('router', 'blocks.0.moe.gate'),))
"""

from __future__ import annotations

import re

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs, as in agent.samples.Sample

MAX_VALUES = 100_000  # values per series, expanded: far beyond any test, short of a memory bomb

_NUMBER = r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?inf|nan"
_UNSIGNED = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
_VALUE = re.compile(rf"(?:{_NUMBER})", re.IGNORECASE)
_EXPAND = re.compile(
    rf"(?P<a>{_NUMBER})(?:(?P<op>[+-])(?P<b>{_UNSIGNED}))?x(?P<n>[0-9]+)", re.IGNORECASE
)
_MISSING = re.compile(r"_(?:x(?P<n>[0-9]+))?")
_TOKEN = re.compile(r"\S+")
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]*")  # agent.rules.schema.METRIC_NAME
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "n": "\n"}


class NotationError(ValueError):
    """A series or a values string that does not parse; ``offset`` is the 0-based index of
    the offending character in the text."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


def expand_values(text: str, *, limit: int = MAX_VALUES) -> list[float | None]:
    """The values of a values string, None for a missing one (see the module docstring)."""
    out: list[float | None] = []
    for match in _TOKEN.finditer(text):
        token, offset = match.group(), match.start()
        values = _expand_token(token, offset)
        if len(out) + len(values) > limit:
            raise NotationError(f"too many values: more than {limit} in one series", offset)
        out += values
    if not out:
        raise NotationError("no values", 0)
    return out


def _expand_token(token: str, offset: int) -> list[float | None]:
    if _VALUE.fullmatch(token):
        return [float(token)]
    missing = _MISSING.fullmatch(token)
    if missing:
        return [None] * (1 if missing.group("n") is None else _count(missing.group("n"), offset))
    expand = _EXPAND.fullmatch(token)
    if expand is None:
        raise NotationError(
            f"invalid value {token!r}: expected a number, '_', 'a+bxn', 'a-bxn', 'axn' or '_xn'",
            offset,
        )
    a = float(expand.group("a"))
    b = 0.0 if expand.group("b") is None else float(expand.group("b"))
    if expand.group("op") == "-":
        b = -b
    n = _count(expand.group("n"), offset)
    return [a + i * b for i in range(n + 1)]


def _count(digits: str, offset: int) -> int:
    if len(digits) > 9:
        raise NotationError(f"repeat count {digits} is too large", offset)
    return int(digits)


def parse_series(text: str) -> tuple[str, Labels]:
    """``metric{label="value", ...}`` -> (metric, sorted label pairs)."""
    pos = _skip_space(text, 0)
    metric = _METRIC.match(text, pos)
    if metric is None:
        raise NotationError("expected a metric name: letters, digits, '_', '.', ':', '/', '-'", pos)
    pos = _skip_space(text, metric.end())
    labels: dict[str, str] = {}
    if pos < len(text) and text[pos] == "{":
        pos = _parse_labels(text, pos + 1, labels)
    pos = _skip_space(text, pos)
    if pos != len(text):
        raise NotationError(f"unexpected {text[pos]!r} after the series", pos)
    return metric.group(), tuple(sorted(labels.items()))


def _parse_labels(text: str, pos: int, labels: dict[str, str]) -> int:
    """Label pairs from just after ``{`` to just after ``}``; returns that position."""
    pos = _skip_space(text, pos)
    if text.startswith("}", pos):
        return pos + 1
    while True:
        name = _LABEL.match(text, pos)
        if name is None:
            raise NotationError("expected a label name", pos)
        if name.group() in labels:
            raise NotationError(f"label {name.group()!r} given twice", pos)
        pos = _skip_space(text, name.end())
        if not text.startswith("=", pos):
            raise NotationError(f"expected '=' after label {name.group()!r}", pos)
        value, pos = _parse_quoted(text, _skip_space(text, pos + 1))
        labels[name.group()] = value
        pos = _skip_space(text, pos)
        if text.startswith("}", pos):
            return pos + 1
        if not text.startswith(",", pos):
            raise NotationError("expected ',' or '}' after a label value", pos)
        pos = _skip_space(text, pos + 1)
        if text.startswith("}", pos):  # a trailing comma
            return pos + 1


def _parse_quoted(text: str, pos: int) -> tuple[str, int]:
    """A quoted label value at ``pos``; returns it and the position after its closing quote."""
    if pos >= len(text) or text[pos] not in "\"'":
        raise NotationError("expected a quoted label value", pos)
    quote, out, i = text[pos], [], pos + 1
    while i < len(text):
        char = text[i]
        if char == quote:
            return "".join(out), i + 1
        if char == "\\":
            escaped = text[i + 1 : i + 2]
            if escaped not in _ESCAPES:
                raise NotationError(f"invalid escape '\\{escaped}' in a label value", i)
            out.append(_ESCAPES[escaped])
            i += 2
            continue
        out.append(char)
        i += 1
    raise NotationError("unterminated label value", pos)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def format_series(metric: str, labels: Labels | dict[str, str]) -> str:
    """The notation of a series (or of an alert: a rule name and its labels)."""
    pairs = sorted(labels.items()) if isinstance(labels, dict) else list(labels)
    if not pairs:
        return metric
    inner = ", ".join(f'{k}="{_escape(v)}"' for k, v in pairs)
    return f"{metric}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
