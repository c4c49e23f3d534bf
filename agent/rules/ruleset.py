"""Loaded rules: each validated rule with where it came from, and the set of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.errors import RuleFileError
from agent.rules.matchers import LabelMatcher
from agent.rules.schema import (
    ActionSpec,
    ClearSpec,
    DetectorSpec,
    Duration,
    ReduceSpec,
    RequiresSpec,
    RuleSpec,
)

T = TypeVar("T")


class _SpecField(Generic[T]):
    """A read-only attribute of ``Rule`` that reads the ``RuleSpec`` field of the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._field = name

    def __get__(self, rule: Rule | None, owner: type | None = None) -> T:
        if rule is None:  # looked up on the class: the descriptor itself
            return self  # type: ignore[return-value]
        return getattr(rule.spec, self._field)


@dataclass(frozen=True)
class Rule:
    """One validated rule, with its file, group and line."""

    spec: RuleSpec
    group: str
    path: str
    line: int
    matcher: LabelMatcher

    # The spec's fields, read through: ``rule.metric`` is ``rule.spec.metric``.
    name = _SpecField[str]()
    metric = _SpecField[str]()
    reduce = _SpecField[ReduceSpec | None]()
    detector = _SpecField[DetectorSpec]()
    requires = _SpecField[RequiresSpec | list[RequiresSpec] | None]()
    # every ``requires`` and ``unless`` signal, each with whether it vetoes
    second_signals = _SpecField[tuple[tuple[RequiresSpec, bool], ...]]()
    for_ = _SpecField[Duration]()
    keep_firing_for = _SpecField[Duration]()
    clear = _SpecField[ClearSpec | None]()
    severity = _SpecField[str]()
    family = _SpecField[str]()
    cooldown = _SpecField[int | None]()
    enabled = _SpecField[bool]()

    @staticmethod
    def from_spec(spec: RuleSpec, group: str = "", path: str = "<memory>", line: int = 0) -> Rule:
        return Rule(spec, group, path, line, LabelMatcher.from_mapping(spec.match))

    @property
    def actions(self) -> tuple[ActionSpec, ...]:
        return tuple(self.spec.actions)

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class RuleSet:
    """Every rule from a set of files, in file order. Rule names are unique."""

    rules: tuple[Rule, ...]
    files: tuple[str, ...] = ()
    groups: tuple[tuple[str, str], ...] = ()  # (file, group name), including empty groups
    detectors: DetectorCatalog | None = None  # the catalog the rules were checked against
    warnings: tuple[RuleFileError, ...] = field(default=())

    def __post_init__(self) -> None:
        names = [r.name for r in self.rules]
        assert len(names) == len(set(names)), "RuleSet rule names must be unique"

    def __iter__(self) -> Iterator[Rule]:
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)
