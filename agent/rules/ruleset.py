"""Loaded rules: each validated rule with where it came from, and the set of them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.errors import RuleFileError
from agent.rules.matchers import LabelMatcher
from agent.rules.schema import ActionSpec, ClearSpec, DetectorSpec, Duration, ReduceSpec, RuleSpec


@dataclass(frozen=True)
class Rule:
    """One validated rule, with its file, group and line."""

    spec: RuleSpec
    group: str
    path: str
    line: int
    matcher: LabelMatcher

    @staticmethod
    def from_spec(spec: RuleSpec, group: str = "", path: str = "<memory>", line: int = 0) -> Rule:
        return Rule(spec, group, path, line, LabelMatcher.from_mapping(spec.match))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def metric(self) -> str:
        return self.spec.metric

    @property
    def reduce(self) -> ReduceSpec | None:
        return self.spec.reduce

    @property
    def detector(self) -> DetectorSpec:
        return self.spec.detector

    @property
    def for_(self) -> Duration:
        return self.spec.for_

    @property
    def keep_firing_for(self) -> Duration:
        return self.spec.keep_firing_for

    @property
    def clear(self) -> ClearSpec | None:
        return self.spec.clear

    @property
    def severity(self) -> str:
        return self.spec.severity

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def actions(self) -> tuple[ActionSpec, ...]:
        return tuple(self.spec.actions)

    @property
    def cooldown(self) -> int:
        return self.spec.cooldown

    @property
    def enabled(self) -> bool:
        return self.spec.enabled

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
