"""Rule unit-test files (``mechwatch test``, modelled on ``promtool test rules``): the format,
and loading one with every problem located as ``file:line:col``.

    rule_files: [router.yaml]          # relative to this file; globs allowed
    interval: 25                       # steps between two values of every input series
    tests:
      - name: a collapse fires and opens a router incident
        interval: 25                   # optional: this test's own interval
        monitored: [router_instability]  # optional: the mechanism families the model has
        input_series:                  # agent.rules.series_notation; first value at step 0
          - series: 'router_entropy_norm{router="blocks.0.moe.gate"}'
            values: '0.9x19 0.1x9'
        alerts_at:                     # step -> the alerts pending or firing then, exactly
          450: []
          700:
            - {rule: routing_entropy_collapse, labels: {router: blocks.0.moe.gate}, state: firing}
        incidents_at:                  # step -> the open incident then; null: none is open
          700: {family: router_instability, onset_step: 625}
        actions_at:                    # step -> what pacing decides in that step's round, exactly
          700:
            - {rule: routing_entropy_collapse, action: lower_lr}

Defaults: ``interval`` 1, ``state`` firing, ``labels`` none, ``verdict`` run, ``monitored``
both mechanism families. An alert may also name its ``onset_step``; an incident its
``severity``, ``evidence`` (the rules behind it, exactly) and ``consequences`` (those of its
evidence taken for consequences of another change, exactly). Unknown keys are errors.

Loading checks the YAML (as rule files: ``agent.rules.yaml_source``), the schema, the series
and values notation (the error points at the offending token), the rule files (their own
located errors), and that every rule and action an expectation names exists.
"""

from __future__ import annotations

import difflib
import glob
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from agent.incidents import FAULT_FAMILIES, SEVERITIES
from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.errors import RuleFileError, RuleFileErrors
from agent.rules.loader import (
    ActionValidator,
    fields_at,
    is_rule_test_file,
    load_rule_files,
    pydantic_message,
    unknown_field_message,
)
from agent.rules.ruleset import RuleSet
from agent.rules.schema import describe
from agent.rules.series_notation import Labels, NotationError, expand_values, parse_series
from agent.rules.yaml_source import (
    LocatedDocument,
    NodePath,
    Position,
    YamlSyntaxError,
    parse_located_yaml,
    read_yaml_file,
)

MECHANISMS = ("fa_precision", "router_instability")
_KEY = "[key]"  # pydantic's marker for an error in a mapping key
T = TypeVar("T")


def _number_as_text(value: Any) -> Any:
    """``values: 5`` and ``head: 3`` mean the text "5" and "3"."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _none_as_empty(value: Any) -> Any:
    """``450:`` with nothing after it means no alerts (or no actions), as ``450: []``."""
    return [] if value is None else value


Text = Annotated[str, BeforeValidator(_number_as_text)]
Step = Annotated[int, Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SeriesSpec(_Strict):
    series: str = Field(description='metric{label="value", ...}')
    values: Text = Field(description="expanding notation, first value at step 0")


class ExpectedAlert(_Strict):
    rule: str = Field(description="the rule's name")
    labels: dict[str, Text] = Field(default_factory=dict, description="the alert's labels")
    state: Literal["pending", "firing"] = Field("firing", description="pending or firing")
    onset_step: int | None = Field(None, description="optional: the alert's onset step")


class ExpectedIncident(_Strict):
    family: Literal[FAULT_FAMILIES] = Field(description="the incident's fault family")  # type: ignore[valid-type]
    onset_step: int | None = Field(None, description="optional: its onset step")
    severity: Literal[SEVERITIES] | None = Field(None, description="optional: its severity")  # type: ignore[valid-type]
    evidence: list[str] | None = Field(None, description="optional: its rules, exactly")
    consequences: list[str] | None = Field(
        None, description="optional: the rules of its evidence taken for consequences, exactly"
    )


class ExpectedAction(_Strict):
    rule: str = Field(description="the firing rule that asks for the action")
    action: str = Field(description="the action's name")
    verdict: Literal["run", "wait", "skip", "escalate"] = Field(
        "run", description="what pacing decides (remediations.pacing)"
    )


AlertList = Annotated[list[ExpectedAlert], BeforeValidator(_none_as_empty)]
ActionList = Annotated[list[ExpectedAction], BeforeValidator(_none_as_empty)]


class TestCaseSpec(_Strict):
    name: str = Field(min_length=1, description="the test's name, unique in the file")
    interval: int | None = Field(None, ge=1, description="this test's own interval (steps)")
    monitored: list[Literal[MECHANISMS]] | None = Field(  # type: ignore[valid-type]
        None, description="the mechanism families the model has (default: both)"
    )
    input_series: list[SeriesSpec] = Field(min_length=1, description="the series fed")
    alerts_at: dict[Step, AlertList] = Field(default_factory=dict)
    incidents_at: dict[Step, ExpectedIncident | None] = Field(default_factory=dict)
    actions_at: dict[Step, ActionList] = Field(default_factory=dict)


class _FileHead(_Strict):
    """A test file with its tests not checked yet (each is checked on its own)."""

    rule_files: list[str] = Field(min_length=1, description="rule files, relative to this file")
    interval: int = Field(1, ge=1, description="steps between two values of every series")
    tests: list[Any] = Field(min_length=1, description="the tests")


class TestFileSpec(_FileHead):
    """A whole test file."""

    tests: list[TestCaseSpec] = Field(min_length=1, description="the tests")


# ----------------------------------------------------------------------------- loaded form


@dataclass(frozen=True)
class InputSeries:
    metric: str
    labels: Labels
    values: list[float | None]  # one per interval from step 0; None: missing


@dataclass(frozen=True)
class At(Generic[T]):
    """An expectation at one step; ``where`` is ``file:line:col`` of its step key."""

    step: int
    where: str
    expected: T


@dataclass
class RuleTest:
    name: str
    where: str
    interval: int
    monitored: frozenset[str]
    series: list[InputSeries]
    alerts_at: list[At[list[ExpectedAlert]]]
    incidents_at: list[At[ExpectedIncident | None]]
    actions_at: list[At[list[ExpectedAction]]]


@dataclass
class RuleTestFile:
    path: str
    ruleset: RuleSet
    tests: list[RuleTest] = field(default_factory=list)


@dataclass(eq=False)
class RuleTestFileError(RuleFileError):
    """A problem in a test file: ``path:line:col: test 'name', field 'f': message``."""

    _: KW_ONLY
    test: str | None = None

    def _render(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}:{self.column}"
        context = [f"test '{self.test}'"] if self.test is not None else []
        context += [f"field '{self.field}'"] if self.field else []
        return ": ".join([where, *([", ".join(context)] if context else []), self.message])


# ----------------------------------------------------------------------------- loading


def load_test_file(
    path: str | Path,
    action_validator: ActionValidator | None = None,
    *,
    detectors: DetectorCatalog | None = None,
) -> RuleTestFile:
    """Read, check and resolve one test file. Raises ``RuleFileErrors`` listing every problem
    (in the test file and in the rule files it names)."""
    name = str(path)
    try:
        text = read_yaml_file(path)
        doc = parse_located_yaml(text)
    except YamlSyntaxError as e:
        raise RuleFileErrors([RuleTestFileError(name, e.line, e.column, e.message)]) from None
    except (OSError, UnicodeDecodeError) as e:
        why = f"not UTF-8 text: {e.reason}" if isinstance(e, UnicodeDecodeError) else e.strerror
        raise RuleFileErrors([RuleTestFileError(name, None, None, f"cannot read: {why}")]) from None
    context = _Context(name, doc, text)
    for dup in doc.duplicate_keys:
        message = f"duplicate key (first at line {dup.first_position[0]})"
        context.add(dup.path, message, position=dup.position)
    if not isinstance(doc.data, dict) and not context.errors:
        got = describe(doc.data)
        context.add((), f"expected a mapping with 'rule_files' and 'tests', got {got}")
    if context.errors:
        raise RuleFileErrors(context.errors)
    try:
        head = _FileHead.model_validate(doc.data)
    except ValidationError as e:
        raise RuleFileErrors([context.pydantic_error(err) for err in e.errors()]) from None
    specs: list[tuple[int, TestCaseSpec]] = []
    for i, raw in enumerate(head.tests):
        try:
            specs.append((i, TestCaseSpec.model_validate(raw)))
        except ValidationError as e:
            context.errors += [context.pydantic_error(err, ("tests", i)) for err in e.errors()]
    unresolved = len(context.errors)
    rule_paths = _rule_paths(head.rule_files, Path(name).parent, context)
    resolved = len(context.errors) == unresolved  # every entry of rule_files names files
    ruleset, rule_errors = RuleSet(()), []
    if rule_paths:
        try:
            ruleset = load_rule_files(rule_paths, action_validator, detectors=detectors)
        except RuleFileErrors as e:
            rule_errors = e.errors
    loaded = RuleTestFile(name, ruleset)
    first_at: dict[str, str] = {}
    for i, test_spec in specs:
        test = _resolve_test(test_spec, ("tests", i), head.interval, context)
        if test_spec.name in first_at:
            message = f"duplicate test name; first at {first_at[test_spec.name]}"
            context.add(("tests", i, "name"), message)
        first_at.setdefault(test_spec.name, test.where)
        if resolved and not rule_errors:  # names are checked against every rule, loaded
            _check_names(test_spec, ("tests", i), ruleset, context)
        loaded.tests.append(test)
    if context.errors or rule_errors:
        raise RuleFileErrors([*sorted(context.errors, key=RuleFileError.sort_key), *rule_errors])
    return loaded


def _rule_paths(entries: Sequence[str], base: Path, context: _Context) -> list[Path]:
    """The rule files named by ``rule_files``, relative to the test file's folder (a glob
    skips test files: ``*.yaml`` names the rule files beside this one, not this one)."""
    paths: list[Path] = []
    for i, entry in enumerate(entries):
        pattern = entry if Path(entry).is_absolute() else str(base / entry)
        if glob.has_magic(entry):
            found = sorted(Path(p) for p in glob.glob(pattern) if not is_rule_test_file(p))
            if not found:
                context.add(("rule_files", i), f"no file matches {pattern}")
            paths += found
        elif not Path(pattern).is_file():
            context.add(("rule_files", i), f"no such rule file: {pattern}")
        else:
            paths.append(Path(pattern))
    return paths


def _resolve_test(spec: TestCaseSpec, at: NodePath, interval: int, context: _Context) -> RuleTest:
    """One test with its series expanded; notation errors go to ``context``."""
    series: list[InputSeries] = []
    seen: dict[tuple[str, Labels], int] = {}
    for j, item in enumerate(spec.input_series):
        path = at + ("input_series", j)
        try:
            metric, labels = parse_series(item.series)
        except NotationError as e:
            context.add_in_scalar(path + ("series",), e.message, e.offset)
            continue
        try:
            values = expand_values(item.values)
        except NotationError as e:
            context.add_in_scalar(path + ("values",), e.message, e.offset)
            continue
        if (metric, labels) in seen:
            message = f"the same series as input_series[{seen[(metric, labels)]}]"
            context.add(path + ("series",), message)
        seen.setdefault((metric, labels), j)
        series.append(InputSeries(metric, labels, values))
    return RuleTest(
        name=spec.name,
        where=context.where(at + ("name",)),
        interval=spec.interval or interval,
        monitored=frozenset(MECHANISMS if spec.monitored is None else spec.monitored),
        series=series,
        alerts_at=_at(spec.alerts_at, at + ("alerts_at",), context),
        incidents_at=_at(spec.incidents_at, at + ("incidents_at",), context),
        actions_at=_at(spec.actions_at, at + ("actions_at",), context),
    )


def _at(by_step: dict[int, T], path: NodePath, context: _Context) -> list[At[T]]:
    return [
        At(step, context.where(path + (step,), key=True), expected)
        for step, expected in sorted(by_step.items())
    ]


def _check_names(spec: TestCaseSpec, at: NodePath, ruleset: RuleSet, context: _Context) -> None:
    """Every rule and action an expectation names exists (a typo must not pass as 'absent')."""
    rules = {r.name: r for r in ruleset}

    def check_rule(name: str, path: NodePath) -> bool:
        if name in rules:
            return True
        close = difflib.get_close_matches(name, list(rules), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        context.add(path, f"no rule named '{name}' in the rule files{hint}")
        return False

    for step, alerts in spec.alerts_at.items():
        for k, alert in enumerate(alerts):
            check_rule(alert.rule, at + ("alerts_at", step, k, "rule"))
    for step, incident in spec.incidents_at.items():
        for key in ("evidence", "consequences"):
            for k, name in enumerate(getattr(incident, key, None) or []):
                check_rule(name, at + ("incidents_at", step, key, k))
    for step, actions in spec.actions_at.items():
        for k, action in enumerate(actions):
            path = at + ("actions_at", step, k)
            if check_rule(action.rule, path + ("rule",)):
                asked = [a.name for a in rules[action.rule].actions]
                if action.action not in asked:
                    listed = ", ".join(asked) or "none"
                    message = f"rule '{action.rule}' does not ask for '{action.action}' ({listed})"
                    context.add(path + ("action",), message)


class _Context:
    """Turns a node path of one test file into a located ``RuleTestFileError``."""

    def __init__(self, path: str, doc: LocatedDocument, text: str) -> None:
        self.path = path
        self.doc = doc
        self.lines = text.splitlines()
        self.errors: list[RuleFileError] = []

    def where(self, node_path: NodePath, *, key: bool = False) -> str:
        line, column = self.doc.position_of(node_path, key=key)
        return f"{self.path}:{line}:{column}"

    def error(
        self,
        node_path: NodePath,
        message: str,
        *,
        key: bool = False,
        position: Position | None = None,
    ) -> RuleTestFileError:
        line, column = position or self.doc.position_of(node_path, key=key)
        test, field_path = self._context(node_path)
        return RuleTestFileError(
            self.path, line, column, message, field=field_path or None, test=test
        )

    def add(self, node_path: NodePath, message: str, **kwargs: Any) -> None:
        self.errors.append(self.error(node_path, message, **kwargs))

    def add_in_scalar(self, node_path: NodePath, message: str, offset: int) -> None:
        """An error ``offset`` characters into a one-line scalar (after its opening quote)."""
        line, column = self.doc.position_of(node_path)
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        start = column - 1 + (1 if source[column - 1 : column] in ("'", '"') else 0)
        value = self._value(node_path)
        if isinstance(value, str) and source[start : start + len(value)] == value:
            column = start + offset + 1  # else (folded, escaped): the scalar's own position
        self.add(node_path, message, position=(line, column))

    def pydantic_error(self, err: Any, prefix: NodePath = ()) -> RuleTestFileError:
        loc = prefix + tuple(err["loc"])
        node_path = tuple(part for part in loc if part != _KEY)
        if err["type"] == "extra_forbidden":
            valid = fields_at(TestFileSpec, loc[:-1])
            return self.error(node_path, unknown_field_message(str(loc[-1]), valid), key=True)
        if err["type"] == "missing":
            return self.error(node_path, "missing required field")
        return self.error(node_path, pydantic_message(err), key=_KEY in loc)

    def _value(self, node_path: NodePath) -> Any:
        node = self.doc.data
        for part in node_path:
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                return None
        return node

    def _context(self, node_path: NodePath) -> tuple[str | None, str]:
        """The test's name (when the path is inside one) and the field path below it: list
        items as ``[i]``, mapping keys (steps included) as ``.key``."""
        test, start = None, 0
        if node_path[:1] == ("tests",) and len(node_path) >= 2:
            name = self._value(node_path[:2] + ("name",))
            if isinstance(name, str) and name:
                test, start = name, 2
        out = ""
        for depth, part in enumerate(node_path):
            is_index = isinstance(self._value(node_path[:depth]), list)
            if depth >= start:
                out += f"[{part}]" if is_index else (f".{part}" if out else str(part))
        return test, out
