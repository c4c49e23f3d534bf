"""Errors in rule files, each pointing at a file, line, column, group, rule and field."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass


@dataclass(eq=False)  # an exception: equal only to itself, and hashable
class RuleFileError(ValueError):
    """One problem in a rule file.

    ``str(error)`` reads like ``rules/x.yaml:12:7: group 'fa', rule 'r', field 'detector.rel':
    expected a number, got 'abc'``. Line and column are 1-based; they are None when the file
    could not be read at all. ``group``, ``rule`` and ``field`` are None when not applicable;
    ``field`` is relative to the innermost named rule or group (``detector.rel``,
    ``actions[1].rollback.margin_steps``), or to the file root when neither has a name.
    """

    path: str
    line: int | None
    column: int | None
    message: str
    _: KW_ONLY
    group: str | None = None
    rule: str | None = None
    field: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self._render())

    def _render(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}:{self.column}"
        context = []
        if self.group is not None:
            context.append(f"group '{self.group}'")
        if self.rule is not None:
            context.append(f"rule '{self.rule}'")
        if self.field is not None:
            context.append(f"field '{self.field}'")
        if context:
            return f"{where}: {', '.join(context)}: {self.message}"
        return f"{where}: {self.message}"

    def __str__(self) -> str:
        return self._render()

    def sort_key(self) -> tuple[str, int, int]:
        return (self.path, self.line or 0, self.column or 0)


class RuleFileErrors(ValueError):
    """Every problem found while loading a set of rule files; ``errors`` lists them in order."""

    def __init__(self, errors: Sequence[RuleFileError]) -> None:
        assert errors, "RuleFileErrors needs at least one error"
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))
