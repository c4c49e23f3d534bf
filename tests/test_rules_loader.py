"""Rule files that must not load, with the exact message (file:line:col, group, rule, field)
for each, and the YAML 1.2 scalar rules the loader uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.rules import (
    DetectorCatalog,
    RuleFileError,
    RuleFileErrors,
    default_rule_files,
    load_rule_files,
    load_rule_text,
)

HEAD = "groups:\n  - name: fa\n    rules:\n      - name: r\n"
OK = (
    "        metric: loss\n"
    "        detector: {type: threshold, above: 2.0}\n"
    "        severity: critical\n"
    "        family: symptom\n"
)


def rule(extra: str = "", **replace: str | None) -> str:
    """A one-rule file (lines 4-8), with keys of the valid rule replaced or dropped (None)
    and ``extra`` lines appended from line 9 on."""
    lines = OK
    for key, value in replace.items():
        new = f"        {key}: {value}\n" if value is not None else ""
        lines = re.sub(rf"^        {key}:.*\n", new, lines, flags=re.M)
    return HEAD + lines + extra


def errors_of(text: str, **kwargs) -> list[str]:
    with pytest.raises(RuleFileErrors) as info:
        load_rule_text(text, "bad.yaml", **kwargs)
    return [str(e) for e in info.value.errors]


MALFORMED = [
    (
        "empty",
        "",
        ["bad.yaml:1:1: file is empty; expected a mapping with a 'groups' list"],
    ),
    (
        "comments_only",
        "# nothing here\n",
        ["bad.yaml:1:1: file is empty; expected a mapping with a 'groups' list"],
    ),
    (
        "top_list",
        "- a\n- b\n",
        ["bad.yaml:1:1: expected a mapping with a 'groups' list at the top level, got a list"],
    ),
    (
        "top_scalar",
        "hello\n",
        ["bad.yaml:1:1: expected a mapping with a 'groups' list at the top level, got 'hello'"],
    ),
    (
        "missing_groups",
        "group: []\n",
        [
            "bad.yaml:1:1: field 'groups': missing required field",
            "bad.yaml:1:1: field 'group': unknown field; did you mean 'groups'?",
        ],
    ),
    (
        "groups_not_list",
        "groups: {}\n",
        ["bad.yaml:1:9: field 'groups': expected a list, got a mapping"],
    ),
    (
        "tab",
        "groups:\n\t- name: fa\n",
        ["bad.yaml:2:1: invalid YAML: tab character; indent with spaces, not tabs"],
    ),
    (
        "syntax",
        HEAD
        + "        metric: loss\n"
        + "        detector: {type: threshold, above: 2.0\n"
        + "        severity: critical\n",
        [
            "bad.yaml:7:17: invalid YAML: expected ',' or '}', but got ':' (while parsing a flow "
            "mapping at line 6, column 19)"
        ],
    ),
    (
        "two_docs",
        "groups: []\n---\ngroups: []\n",
        [
            "bad.yaml:2:1: invalid YAML: expected a single document in the stream, but found "
            "another document"
        ],
    ),
    (
        "dup_key",
        rule("        metric: grad_norm\n"),
        ["bad.yaml:9:9: group 'fa', rule 'r', field 'metric': duplicate key (first at line 5)"],
    ),
    (
        "bool_off",
        rule("        enabled: off\n"),
        ["bad.yaml:9:18: group 'fa', rule 'r', field 'enabled': expected true or false, got 'off'"],
    ),
    (
        "bool_yes",
        rule("        enabled: yes\n"),
        ["bad.yaml:9:18: group 'fa', rule 'r', field 'enabled': expected true or false, got 'yes'"],
    ),
    (
        "unknown_rule_key",
        rule("        detecter: {type: threshold}\n"),
        [
            "bad.yaml:9:9: group 'fa', rule 'r', field 'detecter': unknown field; did you mean "
            "'detector'?"
        ],
    ),
    (
        "unknown_group_key",
        "groups:\n  - name: fa\n    rule: []\n",
        [
            "bad.yaml:2:5: group 'fa', field 'rules': missing required field",
            "bad.yaml:3:5: group 'fa', field 'rule': unknown field; did you mean 'rules'?",
        ],
    ),
    (
        "unknown_reduce_key",
        rule("        reduce: {op: mean, by: [head]}\n"),
        [
            "bad.yaml:9:28: group 'fa', rule 'r', field 'reduce.by': unknown field; valid fields: "
            "op, over, q"
        ],
    ),
    (
        "dup_rule_in_file",
        rule() + "  - name: fb\n    rules:\n      - name: r\n" + OK,
        [
            "bad.yaml:11:15: group 'fb', rule 'r', field 'name': duplicate rule name 'r'; first "
            "defined at bad.yaml:4:15"
        ],
    ),
    (
        "dup_group",
        "groups:\n  - name: fa\n    rules: []\n  - name: fa\n    rules: []\n",
        [
            "bad.yaml:4:11: group 'fa', field 'name': duplicate group name 'fa'; first defined at "
            "line 2"
        ],
    ),
    (
        "bad_regex",
        rule('        match: {layer: "~(ab"}\n'),
        [
            "bad.yaml:9:24: group 'fa', rule 'r', field 'match.layer': invalid regular expression "
            "'(ab': missing ), unterminated subpattern at position 0"
        ],
    ),
    (
        "quantile_no_q",
        rule("        reduce: {op: quantile, over: [head]}\n"),
        [
            "bad.yaml:9:17: group 'fa', rule 'r', field 'reduce': op 'quantile' needs q (between "
            "0 and 1)"
        ],
    ),
    (
        "quantile_q_range",
        rule("        reduce: {op: quantile, q: 1.5}\n"),
        ["bad.yaml:9:35: group 'fa', rule 'r', field 'reduce.q': must be between 0 and 1, got 1.5"],
    ),
    (
        "q_without_quantile",
        rule("        reduce: {op: max, q: 0.5}\n"),
        [
            "bad.yaml:9:17: group 'fa', rule 'r', field 'reduce': q is only used by op "
            "'quantile', not 'max'"
        ],
    ),
    (
        "bad_op",
        rule("        reduce: {op: avg}\n"),
        [
            "bad.yaml:9:22: group 'fa', rule 'r', field 'reduce.op': expected 'min', 'mean', "
            "'max', 'median', 'sum' or 'quantile', got 'avg'"
        ],
    ),
    (
        "negative_for",
        rule("        for: -1\n"),
        ["bad.yaml:9:14: group 'fa', rule 'r', field 'for': must be >= 0, got -1"],
    ),
    (
        "for_string",
        rule("        for: soon\n"),
        [
            "bad.yaml:9:14: group 'fa', rule 'r', field 'for': expected an integer number of "
            "evaluations or a string like '500 steps', got 'soon'"
        ],
    ),
    (
        "keep_bool",
        rule("        keep_firing_for: true\n"),
        [
            "bad.yaml:9:26: group 'fa', rule 'r', field 'keep_firing_for': expected an integer "
            "number of evaluations or a string like '500 steps', got true"
        ],
    ),
    (
        "unknown_detector",
        rule(detector="{type: thresh, above: 2.0}"),
        [
            "bad.yaml:6:26: group 'fa', rule 'r', field 'detector.type': unknown detector type "
            "'thresh'; valid types: baseline, cusum, drawdown, ema_rise, ewma, log_cusum, "
            "page_hinkley, slope, threshold"
        ],
    ),
    (
        "detector_scalar",
        rule(detector="threshold"),
        [
            "bad.yaml:6:19: group 'fa', rule 'r', field 'detector': expected a mapping, got "
            "'threshold'"
        ],
    ),
    (
        "detector_no_type",
        rule(detector="{above: 2.0}"),
        ["bad.yaml:6:19: group 'fa', rule 'r', field 'detector.type': missing required field"],
    ),
    (
        "detector_bad_param",
        rule(detector="{type: baseline, warmup: 6, direction: drop, rel: abc}"),
        ["bad.yaml:6:69: group 'fa', rule 'r', field 'detector.rel': expected a number, got 'abc'"],
    ),
    (
        "detector_unknown_param",
        rule(detector="{type: baseline, warmup: 6, dirction: drop}"),
        [
            "bad.yaml:6:47: group 'fa', rule 'r', field 'detector.dirction': unknown field; did "
            "you mean 'direction'?"
        ],
    ),
    (
        "detector_string_number",
        rule(detector="{type: threshold, above: '2.0'}"),
        [
            "bad.yaml:6:44: group 'fa', rule 'r', field 'detector.above': expected a number, got "
            "'2.0'"
        ],
    ),
    (
        "severity",
        rule(severity="fatal"),
        [
            "bad.yaml:7:19: group 'fa', rule 'r', field 'severity': expected 'info', 'warning' or "
            "'critical', got 'fatal'"
        ],
    ),
    (
        "family",
        rule(family="router"),
        [
            "bad.yaml:8:17: group 'fa', rule 'r', field 'family': expected 'fa_precision', "
            "'router_instability' or 'symptom', got 'router'"
        ],
    ),
    (
        "placeholder",
        rule('        summary: "H fell to {valeu:.3f}"\n'),
        [
            "bad.yaml:9:18: group 'fa', rule 'r', field 'summary': unknown placeholder '{valeu}'; "
            "valid: value, baseline, statistic, onset_step, fired_step, step, rule, metric, "
            "direction, labels[...]"
        ],
    ),
    (
        "format_spec",
        rule('        summary: "{labels[layer]:.3f}"\n'),
        [
            "bad.yaml:9:18: group 'fa', rule 'r', field 'summary': bad format spec '.3f' for "
            "placeholder '{labels[layer]}': Unknown format code 'f' for object of type 'str'"
        ],
    ),
    (
        "positional",
        rule('        suggest: "value {}"\n'),
        [
            "bad.yaml:9:18: group 'fa', rule 'r', field 'suggest': positional placeholder '{}' is "
            "not allowed; use a name: value, baseline, statistic, onset_step, fired_step, step, "
            "rule, metric, direction, labels[...]"
        ],
    ),
    (
        "unbalanced",
        rule('        summary: "value {value"\n'),
        [
            "bad.yaml:9:18: group 'fa', rule 'r', field 'summary': invalid template: expected '}' "
            "before end of string"
        ],
    ),
    (
        "action_two_keys",
        rule("        actions: [page, {rollback: {margin_steps: 1}, page: {}}]\n"),
        [
            "bad.yaml:9:25: group 'fa', rule 'r', field 'actions[1]': an action mapping needs "
            "exactly one key, the action name; got 'rollback', 'page'"
        ],
    ),
    (
        "action_params_scalar",
        rule("        actions: [{rollback: 100}]\n"),
        [
            "bad.yaml:9:19: group 'fa', rule 'r', field 'actions[0]': parameters of action "
            "'rollback' must be a mapping, got 100"
        ],
    ),
    (
        "action_number",
        rule("        actions: [page, 7]\n"),
        [
            "bad.yaml:9:25: group 'fa', rule 'r', field 'actions[1]': expected an action name or "
            "{name: {params}}, got 7"
        ],
    ),
    (
        "missing_metric",
        rule(metric=None),
        ["bad.yaml:4:9: group 'fa', rule 'r', field 'metric': missing required field"],
    ),
    (
        "group_no_name",
        "groups:\n  - rules: []\n",
        ["bad.yaml:2:5: field 'groups[0].name': missing required field"],
    ),
    (
        "group_empty_name",
        "groups:\n  - name: ''\n    rules: []\n",
        ["bad.yaml:2:11: field 'groups[0].name': must not be empty"],
    ),
    (
        "clear_empty",
        rule("        clear: {}\n"),
        [
            "bad.yaml:9:16: group 'fa', rule 'r', field 'clear': needs at least one of: above, "
            "below, baseline_ratio_above, baseline_ratio_below"
        ],
    ),
    (
        "clear_kind",
        rule("        clear: {ratio_above: 0.8}\n"),
        [
            "bad.yaml:9:17: group 'fa', rule 'r', field 'clear.ratio_above': unknown field; did "
            "you mean 'baseline_ratio_above'?"
        ],
    ),
    (
        "clear_nan",
        rule("        clear: {above: .nan}\n"),
        [
            "bad.yaml:9:24: group 'fa', rule 'r', field 'clear.above': must be a finite number, "
            "got nan"
        ],
    ),
    (
        "cooldown_evals",
        rule("        cooldown: 3 evaluations\n"),
        [
            "bad.yaml:9:19: group 'fa', rule 'r', field 'cooldown': counted in steps; write an "
            "integer or 'N steps', got '3 evaluations'"
        ],
    ),
    (
        "cooldown_neg",
        rule("        cooldown: -5\n"),
        ["bad.yaml:9:19: group 'fa', rule 'r', field 'cooldown': must be >= 0, got -5"],
    ),
    (
        "rule_name",
        rule().replace("name: r\n", "name: bad name\n"),
        [
            "bad.yaml:4:15: group 'fa', rule 'bad name', field 'name': invalid rule name 'bad "
            "name'; use letters, digits, '_', '.', ':' or '-'"
        ],
    ),
    (
        "rule_name_int",
        rule().replace("name: r\n", "name: 12\n"),
        ["bad.yaml:4:15: group 'fa', field 'rules[0].name': expected a string, got 12"],
    ),
    (
        "metric_int",
        rule(metric="7"),
        ["bad.yaml:5:17: group 'fa', rule 'r', field 'metric': expected a string, got 7"],
    ),
    (
        "match_bool",
        rule("        match: {layer: true}\n"),
        [
            "bad.yaml:9:24: group 'fa', rule 'r', field 'match.layer': expected a glob or "
            "'~regex' string, got true"
        ],
    ),
    (
        "match_list",
        rule("        match: [layer]\n"),
        ["bad.yaml:9:16: group 'fa', rule 'r', field 'match': expected a mapping, got a list"],
    ),
    (
        "match_key_int",
        rule("        match: {3: x}\n"),
        ["bad.yaml:9:17: group 'fa', rule 'r', field 'match.3': expected a string, got 3"],
    ),
    (
        "requires_detector_param",
        rule(
            "        requires:\n          metric: router_update_rel_norm\n"
            "          detector: {type: baseline, rel: lots}\n"
        ),
        [
            "bad.yaml:11:43: group 'fa', rule 'r', field 'requires.detector.rel': expected a "
            "number, got 'lots'"
        ],
    ),
    (
        "requires_within_negative",
        rule(
            "        requires: {metric: router_update_rel_norm, detector: {type: threshold, "
            "above: 1}, within: -25}\n"
        ),
        ["bad.yaml:9:99: group 'fa', rule 'r', field 'requires.within': must be >= 0, got -25"],
    ),
    (
        "requires_list_item_detector_param",
        rule(
            "        requires:\n          - metric: lr\n"
            "            detector: {type: threshold, above: 0}\n"
            "          - metric: lr\n"
            "            detector: {type: drawdown, ratio: 0.5, span: 100}\n"
        ),
        [
            "bad.yaml:13:47: group 'fa', rule 'r', field 'requires[1].detector.ratio': must be "
            "> 1.0, got 0.5"
        ],
    ),
    (
        "requires_list_item_unknown_field",
        rule("        requires:\n          - {metric: lr, detectr: {type: threshold}}\n"),
        [
            "bad.yaml:10:13: group 'fa', rule 'r', field 'requires[0].detector': missing "
            "required field",
            "bad.yaml:10:26: group 'fa', rule 'r', field 'requires[0].detectr': unknown field; "
            "did you mean 'detector'?",
        ],
    ),
    (
        "requires_empty_list",
        rule("        requires: []\n"),
        [
            "bad.yaml:9:19: group 'fa', rule 'r', field 'requires': an empty list: leave the "
            "key out, or give at least one signal"
        ],
    ),
    (
        "unless_every_not_bool",
        rule("        unless: {metric: lr, detector: {type: threshold, above: 1}, every: yes}\n"),
        [
            "bad.yaml:9:76: group 'fa', rule 'r', field 'unless.every': expected true or "
            "false, got 'yes'"
        ],
    ),
    (
        "rules_not_list",
        "groups:\n  - name: fa\n    rules: {name: r}\n",
        ["bad.yaml:3:12: group 'fa', field 'rules': expected a list, got a mapping"],
    ),
]


@pytest.mark.parametrize(("case", "text", "expected"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_rule_file_gives_exact_located_errors(case, text, expected):
    assert errors_of(text) == expected


def test_error_carries_its_location_as_attributes():
    with pytest.raises(RuleFileErrors) as info:
        load_rule_text(rule(detector="{type: baseline, warmup: 6, rel: abc}"), "x/y.yaml")
    (error,) = info.value.errors
    assert isinstance(error, RuleFileError) and isinstance(error, ValueError)
    assert (error.path, error.line, error.column) == ("x/y.yaml", 6, 52)
    assert (error.group, error.rule, error.field) == ("fa", "r", "detector.rel")
    assert error.message == "expected a number, got 'abc'"
    assert str(info.value) == (
        "x/y.yaml:6:52: group 'fa', rule 'r', field 'detector.rel': expected a number, got 'abc'"
    )


def test_yaml_12_scalars_numbers_and_booleans():
    ruleset = load_rule_text(
        rule(
            "        match: {phase: off, flag: yes, head: 3, when: 2024-01-01}\n"
            "        clear: {above: 1e-4, below: 1E5}\n"
            "        enabled: TRUE\n",
            detector="{type: baseline, warmup: 017, rel: .5, z: 2e+1}",
        )
    )
    (r,) = ruleset.rules
    assert r.matcher.as_mapping() == {
        "phase": "off",
        "flag": "yes",
        "head": "3",
        "when": "2024-01-01",
    }
    assert r.clear.above == 1e-4 and r.clear.below == 1e5
    assert r.detector.params == {"warmup": 17, "rel": 0.5, "z": 20.0}
    assert r.enabled is True


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-4", 1e-4), ("1E5", 1e5), (".5", 0.5), ("-2e-3", -2e-3), ("+3.", 3.0)],
)
def test_scientific_notation_is_a_float(text, value):
    (r,) = load_rule_text(rule(detector=f"{{type: threshold, above: {text}}}")).rules
    assert r.detector.params["above"] == value and isinstance(r.detector.params["above"], float)


def test_durations_cooldown_and_actions_parse():
    (r,) = load_rule_text(
        rule(
            '        for: "500 steps"\n'
            "        keep_firing_for: 3\n"
            "        cooldown: 200 steps\n"
            "        actions: [attention_fp32_backward, {rollback: {margin_steps: 100}}, {page: "
            "}]\n"
        )
    ).rules
    assert (r.for_.count, r.for_.unit) == (500, "steps")
    assert (r.keep_firing_for.count, r.keep_firing_for.unit) == (3, "evaluations")
    assert r.cooldown == 200
    assert [(a.name, a.params) for a in r.actions] == [
        ("attention_fp32_backward", {}),
        ("rollback", {"margin_steps": 100}),
        ("page", {}),
    ]
    assert r.line == 4 and r.group == "fa" and r.source == "<string>:4"


class FakeDetector:
    """A detector type known only to these tests: the catalog is injectable."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")
        level: float = 1.0
        warmup: int = Field(3, ge=1)
        latch: bool = False
        lo: float = 0.0
        hi: float = 1.0

        @model_validator(mode="after")
        def _ordered(self):
            if self.lo > self.hi:
                raise ValueError(f"lo ({self.lo}) must not exceed hi ({self.hi})")
            return self


FAKE = DetectorCatalog(types={"fake": FakeDetector}, build=lambda t, p: FakeDetector())


@pytest.mark.parametrize(
    ("detector", "expected"),
    [
        (
            "{type: fake, latch: off}",
            "bad.yaml:6:39: group 'fa', rule 'r', field 'detector.latch': "
            "expected true or false, got 'off'",
        ),
        (
            "{type: fake, warmup: 2.5}",
            "bad.yaml:6:40: group 'fa', rule 'r', field 'detector.warmup': "
            "expected an integer, got 2.5",
        ),
        (
            "{type: fake, warmup: 0}",
            "bad.yaml:6:40: group 'fa', rule 'r', field 'detector.warmup': must be >= 1, got 0",
        ),
        (
            "{type: fake, lo: 2, hi: 1}",
            "bad.yaml:6:19: group 'fa', rule 'r', field 'detector': lo (2.0) must not exceed hi "
            "(1.0)",
        ),
        (
            "{type: fake, levle: 2}",
            "bad.yaml:6:32: group 'fa', rule 'r', field 'detector.levle': "
            "unknown field; did you mean 'level'?",
        ),
        (
            "{type: threshold, above: 2}",
            "bad.yaml:6:26: group 'fa', rule 'r', field 'detector.type': "
            "unknown detector type 'threshold'; valid types: fake",
        ),
    ],
)
def test_detector_params_are_checked_strictly_against_the_catalog(detector, expected):
    assert errors_of(rule(detector=detector), detectors=FAKE) == [expected]


def test_action_validator_errors_are_located():
    class Rollback(BaseModel):
        model_config = ConfigDict(extra="forbid")
        margin_steps: int = Field(0, ge=0)

    def validate_action(name: str, params: dict) -> None:
        if name == "rollback":
            Rollback.model_validate(params, strict=True)
        elif name != "page":
            raise ValueError(f"unknown action '{name}'; valid actions: page, rollback")

    text = rule(
        "        actions:\n          - pgae\n          - rollback: {margin_steps: -1, x: 1}\n"
    )
    assert errors_of(text, action_validator=validate_action) == [
        "bad.yaml:10:13: group 'fa', rule 'r', field 'actions[0]': "
        "unknown action 'pgae'; valid actions: page, rollback",
        "bad.yaml:11:38: group 'fa', rule 'r', field 'actions[1].rollback.margin_steps': "
        "must be >= 0, got -1",
        "bad.yaml:11:42: group 'fa', rule 'r', field 'actions[1].rollback.x': unknown field",
    ]
    # Without a validator only the syntax is checked.
    assert len(load_rule_text(text).rules[0].actions) == 2


def test_all_errors_of_all_files_are_collected_in_file_order(tmp_path: Path):
    first = tmp_path / "a.yaml"
    second = tmp_path / "b.yaml"
    first.write_text(rule("        for: -1\n", severity="fatal"))
    second.write_text(
        rule().replace("name: fa", "name: fb") + "      - name: s\n" + OK + "        bogus: 1\n"
    )
    with pytest.raises(RuleFileErrors) as info:
        load_rule_files([first, second, tmp_path / "missing.yaml"])
    assert str(info.value).splitlines() == [
        f"{first}:7:19: group 'fa', rule 'r', field 'severity': "
        "expected 'info', 'warning' or 'critical', got 'fatal'",
        f"{first}:9:14: group 'fa', rule 'r', field 'for': must be >= 0, got -1",
        f"{second}:4:15: group 'fb', rule 'r', field 'name': "
        f"duplicate rule name 'r'; first defined at {first}:4:15",
        f"{second}:14:9: group 'fb', rule 's', field 'bogus': unknown field; valid fields: "
        "name, metric, match, reduce, detector, requires, unless, for, keep_firing_for, clear, "
        "severity, family, actions, start_step, cooldown, summary, suggest, enabled",
        f"{tmp_path / 'missing.yaml'}: cannot read: No such file or directory",
    ]


def test_a_directory_loads_its_yaml_files_sorted(tmp_path: Path):
    (tmp_path / "b.yaml").write_text(rule())
    (tmp_path / "a.yml").write_text(rule().replace("name: r\n", "name: q\n"))
    (tmp_path / "notes.txt").write_text("not a rule file")
    ruleset = load_rule_files([tmp_path])
    assert [r.name for r in ruleset] == ["q", "r"]
    assert ruleset.files == (str(tmp_path / "a.yml"), str(tmp_path / "b.yaml"))


def test_unknown_metric_is_a_warning_with_a_suggestion():
    ruleset = load_rule_text(rule(metric="qk_delta2_entropi"), "w.yaml")
    assert len(ruleset) == 1
    assert [str(w) for w in ruleset.warnings] == [
        "w.yaml:5:17: group 'fa', rule 'r', field 'metric': metric 'qk_delta2_entropi' is not "
        "produced by a built-in monitor; did you mean 'qk_delta2_entropy'? "
        "(fine if your own code logs it)"
    ]
    assert load_rule_text(rule()).warnings == ()


def test_merge_keys_share_settings_without_duplicate_key_errors():
    text = "defaults: &defaults {severity: warning, family: symptom}\ngroups: []\n"
    assert errors_of(text) == [
        "bad.yaml:1:1: field 'defaults': unknown field; valid fields: groups"
    ]
    text = (
        "groups:\n"
        "  - name: fa\n"
        "    rules:\n"
        "      - &base {name: a, metric: loss, severity: info, family: symptom,\n"
        "               detector: {type: threshold, above: 1}}\n"
        "      - <<: *base\n"
        "        name: b\n"
        "        severity: critical\n"
    )
    ruleset = load_rule_text(text)
    assert [(r.name, r.severity) for r in ruleset] == [("a", "info"), ("b", "critical")]


def test_shipped_rule_packs_all_load():
    files = default_rule_files()
    assert all(f.suffix == ".yaml" and f.is_file() for f in files)
    ruleset = load_rule_files(files)
    assert len(ruleset.files) == len(files)


def test_shipped_rate_rules_on_qk_metrics_are_given_per_the_default_qk_delta():
    # k and min_updates count read-outs: a shipped rule on a metric read every qk.delta steps
    # says per how many steps they were tuned, so another cadence rescales them (log_cusum
    # per_steps; without it, qk.delta 12 lost 3 of 15 harmful FA faults on fresh seeds).
    from agent.config import QKMonitorConfig  # noqa: PLC0415

    delta = QKMonitorConfig().delta
    qk_rules = [
        r
        for r in load_rule_files(default_rule_files())
        if r.detector.type == "log_cusum"
        and (r.metric.startswith(("qk_", "dwq_")) or r.metric == "control_update_entropy")
        and r.enabled
    ]
    assert {r.name for r in qk_rules} >= {
        "qk_delta2_entropy_collapse",
        "qk_delta2_entropy_collapse_deep",
        "block_update_collapse",
    }
    assert all(r.detector.params.get("per_steps") == delta for r in qk_rules)


def test_located_yaml_positions_scalars_and_duplicates():
    from agent.rules.yaml_source import parse_located_yaml

    doc = parse_located_yaml("a: [.inf, 0x1f, 0o17, 1:30, ~, null, NO, True]\nb:\n  c: 1\n  c: 2\n")
    assert doc.data["a"][:2] == [float("inf"), 31]
    assert doc.data["a"][2:] == [15, "1:30", None, None, "NO", True]
    assert doc.value_positions[("a", 3)] == (1, 23)
    assert doc.key_positions[("b", "c")] == (3, 3)
    (dup,) = doc.duplicate_keys
    assert (dup.path, dup.position, dup.first_position) == (("b", "c"), (4, 3), (3, 3))
