"""The YAML rule format, as pydantic models that mirror the file.

A rule file is a mapping with one key, ``groups``; each group has a ``name`` and ``rules``::

    groups:
      - name: fa_precision
        rules:
          - name: qk_delta2_entropy_collapse
            metric: qk_delta2_entropy
            match: {layer: "*"}
            reduce: {op: mean, over: [head]}
            detector: {type: baseline, warmup: 6, direction: drop, rel: 0.5}
            for: 2
            keep_firing_for: 3
            clear: {baseline_ratio_above: 0.8}
            severity: critical
            family: fa_precision
            actions: [attention_fp32_backward, {rollback: {margin_steps: 100}}, page]
            cooldown: 500
            summary: "H(Delta_2) of {labels[layer]} fell to {value:.3f}"
            suggest: "Run the attention backward in FP32."

Every model forbids unknown keys and validates strictly (a string is never read as a number
or a boolean). Detector parameters and action parameters are checked by the loader against
the detector and action registries, which this module does not know.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    InstanceOf,
    Tag,
    field_validator,
    model_validator,
)

from agent.incidents import EVIDENCE_FAMILIES, SEVERITIES
from agent.rules.matchers import LabelPattern
from agent.rules.templates import check_template

Family = Literal["fa_precision", "router_instability", "symptom"]
SeverityName = Literal["info", "warning", "critical"]
ReduceOp = Literal["min", "mean", "max", "median", "sum", "quantile"]
assert set(Family.__args__) == set(EVIDENCE_FAMILIES), "schema.Family out of date"
assert set(SeverityName.__args__) == set(SEVERITIES), "schema.SeverityName out of date"

RULE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$")
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")


def _check_metric_name(metric: str) -> str:
    if not METRIC_NAME.match(metric):
        raise ValueError(f"invalid metric name {metric!r}")
    return metric


MetricName = Annotated[str, AfterValidator(_check_metric_name)]
_DURATION = re.compile(r"^\s*(-?\d+)\s*(steps?|evaluations?|evals?)\s*$")


def describe(value: Any) -> str:
    """How an offending YAML value is quoted in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


@dataclass(frozen=True)
class Duration:
    """How long a condition must hold: a number of evaluations (samples of the series fed to
    the rule) or of training steps."""

    count: int
    unit: Literal["evaluations", "steps"] = "evaluations"

    def __str__(self) -> str:
        return str(self.count) if self.unit == "evaluations" else f"{self.count} steps"


def parse_duration(value: Any) -> Duration:
    if isinstance(value, Duration):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return Duration(value, "evaluations")
    if isinstance(value, str) and (m := _DURATION.match(value)):
        count = int(m.group(1))
        if count < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
        unit = "steps" if m.group(2).startswith("step") else "evaluations"
        return Duration(count, unit)
    raise ValueError(
        f"expected an integer number of evaluations or a string like '500 steps', "
        f"got {describe(value)}"
    )


def parse_optional_steps(value: Any) -> int | None:
    """``parse_steps``, or None for an omitted value."""
    return None if value is None else parse_steps(value)


def parse_steps(value: Any) -> int:
    """A count of training steps: an integer or 'N steps'."""
    duration = parse_duration(value)
    if duration.unit != "steps" and isinstance(value, str):
        raise ValueError(f"counted in steps; write an integer or 'N steps', got {value!r}")
    return duration.count


@dataclass(frozen=True)
class ActionSpec:
    """One action a firing rule asks for: its registry name and its parameters."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.params:
            return self.name
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({inner})"


_ACTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_action(value: Any) -> ActionSpec:
    if isinstance(value, ActionSpec):
        return value
    if isinstance(value, str):
        name, params = value, None
    elif isinstance(value, dict):
        if len(value) != 1:
            keys = ", ".join(repr(k) for k in value) or "none"
            raise ValueError(
                f"an action mapping needs exactly one key, the action name; got {keys}"
            )
        ((name, params),) = value.items()
        if not isinstance(name, str):
            raise ValueError(f"an action name must be a string, got {describe(name)}")
        if params is not None and not isinstance(params, dict):
            raise ValueError(
                f"parameters of action '{name}' must be a mapping, got {describe(params)}"
            )
    else:
        raise ValueError(f"expected an action name or {{name: {{params}}}}, got {describe(value)}")
    if not _ACTION_NAME.match(name):
        raise ValueError(f"invalid action name {name!r}")
    return ActionSpec(name, dict(params or {}))


def _parse_pattern(value: Any) -> LabelPattern:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # `head: 3` means the label value "3"
    if not isinstance(value, str):
        raise ValueError(f"expected a glob or '~regex' string, got {describe(value)}")
    return LabelPattern.parse(value)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ReduceSpec(_Strict):
    """How the matching series are combined, per step, before the detector sees them."""

    op: ReduceOp = Field(
        description="min | mean | max | median | sum | quantile (quantile needs q); NaN in, NaN out"
    )
    over: list[str] | None = Field(
        default=None,
        description="labels reduced away; the remaining labels name the alert. Omitted: all "
        "labels, one alert for the whole rule",
    )
    q: float | None = Field(
        default=None, description="quantile in [0, 1] for op 'quantile' (linear interpolation)"
    )

    @field_validator("q")
    @classmethod
    def _q_in_range(cls, q: float | None) -> float | None:
        if q is not None and not 0.0 <= q <= 1.0:
            raise ValueError(f"must be between 0 and 1, got {q}")
        return q

    @model_validator(mode="after")
    def _q_matches_op(self) -> ReduceSpec:
        if self.op == "quantile" and self.q is None:
            raise ValueError("op 'quantile' needs q (between 0 and 1)")
        if self.op != "quantile" and self.q is not None:
            raise ValueError(f"q is only used by op 'quantile', not '{self.op}'")
        return self


class ClearSpec(_Strict):
    """Hysteresis: once firing, the alert resolves only when every given condition holds."""

    above: float | None = Field(default=None, allow_inf_nan=False, description="value > this")
    below: float | None = Field(default=None, allow_inf_nan=False, description="value < this")
    baseline_ratio_above: float | None = Field(
        default=None, allow_inf_nan=False, description="value / baseline > this"
    )
    baseline_ratio_below: float | None = Field(
        default=None, allow_inf_nan=False, description="value / baseline < this"
    )

    @model_validator(mode="after")
    def _has_a_condition(self) -> ClearSpec:
        if all(v is None for v in self.model_dump().values()):
            raise ValueError(
                "needs at least one of: above, below, baseline_ratio_above, baseline_ratio_below"
            )
        return self

    def holds(self, value: float | None, baseline: float | None) -> bool:
        """True when every given condition holds; a ratio needs a finite non-zero baseline."""
        if value is None:
            return False
        if self.above is not None and not value > self.above:
            return False
        if self.below is not None and not value < self.below:
            return False
        if self.baseline_ratio_above is not None or self.baseline_ratio_below is not None:
            if baseline is None or baseline == 0 or baseline != baseline:
                return False
            ratio = value / baseline
            if self.baseline_ratio_above is not None and not ratio > self.baseline_ratio_above:
                return False
            if self.baseline_ratio_below is not None and not ratio < self.baseline_ratio_below:
                return False
        return True


class DetectorSpec(BaseModel):
    """Which detector judges the reduced series: ``type`` plus that detector's parameters,
    side by side (``{type: baseline, warmup: 6, rel: 0.5}``)."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    type: str = Field(description="detector type: threshold, baseline, slope, ewma, cusum, ...")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    def __str__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.type}({inner})"


class RequiresSpec(_Strict):
    """A second, independent signal the rule's condition needs (``requires``) or that vetoes it
    (``unless``): ``metric``, selected with the rule's own ``match`` and ``reduce`` (so per the
    same alert labels), triggered its ``detector`` within the last ``within`` steps (with
    ``every``: at every one of its evaluations there, and there was one). It opens no alert of
    its own. Its own ``reduce`` replaces the rule's for the second signal: labels it reduces away
    are not compared, so a signal reduced over every router holds for each router's alert."""

    metric: MetricName = Field(description="metric name of the second signal")
    detector: DetectorSpec = Field(description="detector type and its parameters")
    within: Annotated[int, BeforeValidator(parse_steps)] = Field(
        default=0,
        ge=0,
        description="steps: the second signal triggered at most this long before (or at) the "
        "step the rule's own detector triggers",
    )
    reduce: ReduceSpec | None = Field(
        default=None,
        description="combine the second signal's series per step with this reduction instead "
        "of the rule's own (over: [router]: one signal for all routers, which then holds for "
        "every alert of the rule)",
    )
    every: bool = Field(
        default=False,
        description="the second signal holds only if it triggered at every one of its "
        "evaluations within 'within' steps (and there was at least one); false: at one of them",
    )


# ``requires`` and ``unless`` take one signal (a mapping, as before 2026-12-07) or a list. The
# union is told apart by the value's shape; pydantic puts the shape's tag in an error's location
# (the loader drops these tags, so an error names the field as the file spells it).
ONE_SIGNAL, SIGNAL_LIST = "<one signal>", "<signal list>"
SHAPE_TAGS = frozenset({ONE_SIGNAL, SIGNAL_LIST})


def _signal_shape(value: Any) -> str:
    return SIGNAL_LIST if isinstance(value, list) else ONE_SIGNAL


SecondSignals = Annotated[
    Annotated[RequiresSpec, Tag(ONE_SIGNAL)] | Annotated[list[RequiresSpec], Tag(SIGNAL_LIST)],
    Discriminator(_signal_shape),
]


class RuleSpec(_Strict):
    """One rule: which series, which detector, how long, what it means and what to do."""

    name: str = Field(
        description="unique name across all loaded files; the alert's identity with its labels"
    )
    metric: MetricName = Field(
        description="metric name, see agent/samples.py (custom metrics allowed)"
    )
    match: dict[str, Annotated[InstanceOf[LabelPattern], BeforeValidator(_parse_pattern)]] = Field(
        default_factory=dict,
        description="label -> glob or '~regex' (whole value); a series must carry each label",
    )
    reduce: ReduceSpec | None = Field(
        default=None, description="combine series per step; omitted: one alert per label set"
    )
    detector: DetectorSpec = Field(description="detector type and its parameters")
    requires: SecondSignals | None = Field(
        default=None,
        description="a second signal, or a list of them: the condition holds only while the "
        "detector triggers and each of these triggered within its 'within' steps (for the same "
        "labels)",
    )
    unless: SecondSignals | None = Field(
        default=None,
        description="a signal, or a list of them, that vetoes the condition: it does not hold "
        "while one of these triggered within its 'within' steps (for agreeing labels)",
    )
    for_: Annotated[InstanceOf[Duration], BeforeValidator(parse_duration)] = Field(
        default=Duration(0),
        alias="for",
        description="evaluations (int) or 'N steps' the condition must hold before firing",
    )
    keep_firing_for: Annotated[InstanceOf[Duration], BeforeValidator(parse_duration)] = Field(
        default=Duration(0),
        description="evaluations (int) or 'N steps' to stay firing after the condition stops",
    )
    clear: ClearSpec | None = Field(
        default=None, description="optional hysteresis: once firing, resolve only when it holds"
    )
    severity: SeverityName = Field(description="info | warning | critical")
    family: Family = Field(description="fa_precision | router_instability | symptom")
    actions: list[Annotated[InstanceOf[ActionSpec], BeforeValidator(parse_action)]] = Field(
        default_factory=list,
        description="action names or {name: {params}} mappings, run in order when it fires",
    )
    start_step: Annotated[int, BeforeValidator(parse_steps)] = Field(
        default=0,
        ge=0,
        description="ignore samples measured before this step (the early phase, e.g. the LR "
        "warm-up, when healthy monitors move fast); the detector's warm-up starts after it",
    )
    cooldown: Annotated[int | None, BeforeValidator(parse_optional_steps)] = Field(
        default=None,
        ge=0,
        description="steps between two runs of each of this rule's actions (while it keeps "
        "firing, or when it fires again); an action's own 'cooldown' key wins; omitted: each "
        "action's default (remediations.pacing)",
    )
    summary: str = Field(
        default="{metric} = {value:.4g} (baseline {baseline:.4g}, onset step {onset_step})",
        description="one-line text; placeholders as in agent/rules/templates.py",
    )
    suggest: str = Field(default="", description="what a person should do; same placeholders")
    enabled: bool = Field(default=True, description="false keeps the rule but never evaluates it")

    @property
    def second_signals(self) -> tuple[tuple[RequiresSpec, bool], ...]:
        """Every ``requires`` and ``unless`` signal, in file order, each with whether it vetoes
        (``unless``) rather than enables the condition."""
        out: list[tuple[RequiresSpec, bool]] = []
        for specs, veto in ((self.requires, False), (self.unless, True)):
            if specs is not None:
                out += [(spec, veto) for spec in (specs if isinstance(specs, list) else [specs])]
        return tuple(out)

    @field_validator("requires", "unless")
    @classmethod
    def _signals_listed(cls, specs: SecondSignals | None) -> SecondSignals | None:
        if isinstance(specs, list) and not specs:
            raise ValueError("an empty list: leave the key out, or give at least one signal")
        return specs

    @field_validator("name")
    @classmethod
    def _name_is_identifier(cls, name: str) -> str:
        if not RULE_NAME.match(name):
            raise ValueError(
                f"invalid rule name {name!r}; use letters, digits, '_', '.', ':' or '-'"
            )
        return name

    @field_validator("summary", "suggest")
    @classmethod
    def _template_is_valid(cls, template: str) -> str:
        check_template(template)
        return template


class GroupSpec(_Strict):
    """A named list of rules (names only organise the file; rule names are global)."""

    name: str = Field(min_length=1, description="group name, unique within the file")
    rules: list[RuleSpec] = Field(description="the group's rules")


class RuleFileSpec(_Strict):
    """A whole rule file."""

    groups: list[GroupSpec] = Field(description="rule groups")
