"""Label matchers: which series of a metric a rule looks at.

A matcher maps label names to patterns. A pattern is a shell glob (``*``, ``?``, ``[..]``,
matched against the whole value, case-sensitive) or, when it starts with ``~``, a Python
regular expression that must match the whole value (``~layers\\.(1|2)\\..*``). A series
matches when it carries every named label and each value matches its pattern; labels the
matcher does not name are ignored.

>>> m = LabelMatcher.from_mapping({"layer": "*.self_attn", "head": "~[0-3]"})
>>> m.matches((("head", "2"), ("layer", "model.layers.0.self_attn")))
True
>>> m.matches((("layer", "model.layers.0.self_attn"),))
False
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs, as in agent.samples.Sample


@dataclass(frozen=True)
class LabelPattern:
    """One compiled pattern; ``source`` is what the user wrote."""

    source: str
    regex: re.Pattern[str]

    @staticmethod
    def parse(source: str) -> LabelPattern:
        """Compile a glob or ``~regex``. ValueError names the pattern and the regex problem."""
        if not isinstance(source, str):
            raise ValueError(f"expected a string pattern, got {source!r}")
        if source.startswith("~"):
            try:
                return LabelPattern(source, re.compile(source[1:]))
            except re.error as e:
                raise ValueError(f"invalid regular expression {source[1:]!r}: {e}") from None
        return LabelPattern(source, re.compile(fnmatch.translate(source)))

    def matches(self, value: str) -> bool:
        return self.regex.fullmatch(value) is not None


@dataclass(frozen=True)
class LabelMatcher:
    """All patterns of one rule; an empty matcher matches every series."""

    patterns: tuple[tuple[str, LabelPattern], ...] = ()

    @staticmethod
    def from_mapping(patterns: Mapping[str, str | LabelPattern] | None) -> LabelMatcher:
        compiled = []
        for key, pattern in sorted((patterns or {}).items()):
            if not isinstance(pattern, LabelPattern):
                pattern = LabelPattern.parse(pattern)
            compiled.append((key, pattern))
        return LabelMatcher(tuple(compiled))

    def matches(self, labels: Labels) -> bool:
        if not self.patterns:
            return True
        values = dict(labels)
        for key, pattern in self.patterns:
            value = values.get(key)
            if value is None or not pattern.matches(value):
                return False
        return True

    def as_mapping(self) -> dict[str, str]:
        return {key: pattern.source for key, pattern in self.patterns}
