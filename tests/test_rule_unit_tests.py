"""`mechwatch test`: rule unit tests in promtool's format, run through the live decision round.

The shipped packs' tests pass (so CI runs them); the runner's expanding notation, its failure
message, its located errors for malformed files and its handling of missing values are pinned.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from agent.cli import main
from agent.detectors import DETECTORS, build_detector
from agent.rules.detector_catalog import DetectorCatalog
from agent.rules.loader import default_rule_files, load_rule_files
from agent.rules.series_notation import NotationError, expand_values, parse_series
from agent.rules.unit_test_file import load_test_file
from agent.rules.unit_tests import cli_test, shipped_test_files
from remediations.pacing import PacingLimits

ROOT = Path(__file__).resolve().parent.parent
PACKS = ("fa_precision", "router", "symptoms")

RULES = """\
groups:
  - name: g
    rules:
      - name: high
        metric: x
        detector: {type: threshold, above: 1}
        for: 1
        severity: warning
        family: symptom
        actions: [page]
      - name: mean_high
        metric: y
        reduce: {op: mean}
        detector: {type: threshold, above: 1.5}
        severity: info
        family: symptom
"""


def _run(
    tmp_path: Path, test_text: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    (tmp_path / "r.yaml").write_text(RULES)
    path = tmp_path / "t_test.yaml"
    path.write_text(test_text)
    code = main(["test", str(path)])
    out, err = capsys.readouterr()
    return code, out.replace(str(path), "T"), err.replace(str(path), "T")


# ----------------------------------------------------------------------------- shipped packs


def test_every_shipped_pack_has_tests_and_they_pass(capsys):
    files = sorted((ROOT / "rules").glob("*_test.yaml"))
    assert [f.name for f in files] == [f"{p}_test.yaml" for p in PACKS]
    assert main(["test", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"SUCCESS: \d+ tests passed in 3 files", out.splitlines()[-1])
    assert all(f"{f}: " in out and " tests passed" in out for f in files)


@pytest.mark.parametrize("pack", PACKS)
def test_every_shipped_rule_is_tested_firing_and_quiet(pack: str):
    """Each enabled rule of a pack is expected to fire in some test and to stay quiet in
    another (a rule shipped disabled never fires)."""
    loaded = load_test_file(ROOT / "rules" / f"{pack}_test.yaml")
    rules = {r.name for r in load_rule_files([ROOT / "rules" / f"{pack}.yaml"]) if r.enabled}
    firing = {
        alert.rule
        for test in loaded.tests
        for at in test.alerts_at
        for alert in at.expected
        if alert.state == "firing"
    }
    quiet_tests = [t for t in loaded.tests if any(not at.expected for at in t.alerts_at)]
    assert rules <= firing, rules - firing
    assert quiet_tests


def test_without_arguments_it_runs_the_installed_packs_tests(capsys):
    assert [p.name for p in shipped_test_files()] == [f"{p}_test.yaml" for p in PACKS]
    assert main(["test", "--run", "collapse fires"]) == 0
    out = capsys.readouterr().out
    assert "router_test.yaml: 1 test passed" in out and "symptoms_test.yaml: 0 tests" in out


def test_test_files_are_not_rule_files(tmp_path: Path):
    assert all(not p.name.endswith("_test.yaml") for p in default_rule_files())
    (tmp_path / "a.yaml").write_text(RULES)
    (tmp_path / "a_test.yaml").write_text("rule_files: [a.yaml]\ntests: []\n")
    assert load_rule_files([tmp_path]).files == (str(tmp_path / "a.yaml"),)


# ----------------------------------------------------------------------------- notation


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ("-2+4x3", [-2.0, 2.0, 6.0, 10.0]),  # promtool's examples
        (" 1-2x4", [1.0, -1.0, -3.0, -5.0, -7.0]),
        ("1x4", [1.0] * 5),
        ("1 _x3 2", [1.0, None, None, None, 2.0]),  # _xn: n missing values, not n + 1
        ("_ 5 _", [None, 5.0, None]),
        ("0.3x0", [0.3]),
        ("0.9-0.1x3", [0.9, 0.9 - 0.1, 0.9 - 2 * 0.1, 0.9 - 3 * 0.1]),  # a + i*b, not summed
        ("1e-4x1 -1.5e2 .5", [1e-4, 1e-4, -150.0, 0.5]),
        ("1e-4+1e-5x2", [1e-4, 1e-4 + 1e-5, 1e-4 + 2e-5]),
        ("\t3\n 4 ", [3.0, 4.0]),
    ],
)
def test_expanding_notation(text: str, values: list[float | None]):
    assert expand_values(text) == values


def test_expanding_notation_non_finite_values():
    values = expand_values("Inf -inf NaN nanx1 +INFx0")
    assert values[:2] == [float("inf"), float("-inf")] and values[-1] == float("inf")
    assert len(values) == 6 and all(v != v for v in values[2:5])  # NaN, then nanx1: 2 NaNs


@pytest.mark.parametrize(
    ("text", "offset", "message"),
    [
        ("1 2 1+x3", 4, "invalid value '1+x3'"),
        ("x3", 0, "invalid value 'x3'"),
        ("1+-2x3", 0, "invalid value '1+-2x3'"),
        ("1+infx3", 0, "invalid value '1+infx3'"),
        ("1x2.5", 0, "invalid value '1x2.5'"),
        ("  ", 0, "no values"),
        ("1 1x9999999999", 2, "repeat count 9999999999 is too large"),
    ],
)
def test_expanding_notation_errors_point_at_the_token(text: str, offset: int, message: str):
    with pytest.raises(NotationError) as caught:
        expand_values(text)
    assert caught.value.offset == offset and caught.value.message.startswith(message)


def test_expanding_notation_refuses_a_memory_bomb():
    with pytest.raises(NotationError, match="too many values: more than 100000"):
        expand_values("1x60000 2x60000")


def test_series_notation():
    assert parse_series("loss") == ("loss", ())
    assert parse_series(' m { b = \'x\' , a="y\\"z\\\\", } ') == ("m", (("a", 'y"z\\'), ("b", "x")))
    assert parse_series("m{}") == ("m", ())
    for text, offset in [("9m", 0), ("m{a}", 3), ("m{a=x}", 4), ('m{a="1",a="2"}', 8)]:
        with pytest.raises(NotationError) as caught:
            parse_series(text)
        assert caught.value.offset == offset, text


# ----------------------------------------------------------------------------- the runner


def test_a_failing_test_names_the_test_step_rule_expected_and_got(tmp_path: Path, capsys):
    code, out, err = _run(
        tmp_path,
        "rule_files: [r.yaml]\n"
        "interval: 10\n"
        "tests:\n"
        "  - name: fires one evaluation after it is pending\n"
        "    input_series:\n"
        "      - {series: 'x{host=\"a\"}', values: '0 2 2 0'}\n"
        "    alerts_at:\n"
        "      10:\n"
        "        - {rule: high, labels: {host: a}}\n"
        "      20:\n"
        "        - {rule: high, labels: {host: a}}\n"
        "    incidents_at:\n"
        "      10: {family: unattributed}\n"
        "    actions_at:\n"
        "      20: [{rule: high, action: page}]\n"
        "      25: [{rule: high, action: page}]\n",
        capsys,
    )
    assert code == 1 and err == ""
    assert out.splitlines() == [
        "T:8:7: FAILED test 'fires one evaluation after it is pending', step 10, rule high",
        '  expected: high{host="a"} firing',
        '  got:      high{host="a"} pending',
        "T:13:7: FAILED test 'fires one evaluation after it is pending', step 10, incident",
        "  expected: family unattributed",
        "  got:      no open incident",
        "T:16:7: FAILED test 'fires one evaluation after it is pending', step 25, rule high",
        "  expected: action page: run",
        "  got:      (no round at this step: no series has a value here)",
        "T: 1 of 1 test failed",
        "FAILED: 1 of 1 test failed",
    ]


def test_missing_values_are_no_rounds_and_the_state_holds_between_rounds(tmp_path, capsys):
    # x: pending at 10, no round at 20 (still pending), firing at 30 (for: 1), resolved at 60.
    # y (mean over both series, one round per step with whatever has a value): 1 at 0, 2 at
    # 10 (b missing: the mean of a alone), 1 at 20.
    code, out, _ = _run(
        tmp_path,
        "rule_files: [r.yaml]\n"
        "interval: 10\n"
        "tests:\n"
        "  - name: gaps\n"
        "    input_series:\n"
        "      - {series: 'x{host=\"a\"}', values: '0 2 _ 2 _x2 0'}\n"
        "      - {series: 'y{host=\"a\"}', values: '2 2 2'}\n"
        "      - {series: 'y{host=\"b\"}', values: '0 _ 0'}\n"
        "    alerts_at:\n"
        "      0: []\n"
        "      10:\n"
        "        - {rule: high, labels: {host: a}, state: pending, onset_step: 10}\n"
        "        - {rule: mean_high, onset_step: 10}\n"
        "      20: [{rule: high, labels: {host: a}, state: pending}]\n"
        "      30: [{rule: high, labels: {host: a}, onset_step: 10}]\n"
        "      59: [{rule: high, labels: {host: a}}]\n"
        "      60: []\n"
        "    incidents_at:\n"
        "      30: {family: unattributed, onset_step: 10, evidence: [high]}\n"
        "      60: null\n"
        "    actions_at:\n"
        "      30: [{rule: high, action: page}]\n"
        "      40: []\n",
        capsys,
    )
    assert (code, out.splitlines()[-1]) == (0, "SUCCESS: 1 test passed in 1 file")


def test_malformed_test_files_get_located_errors(tmp_path: Path, capsys):
    code, out, err = _run(
        tmp_path,
        "rule_files: [r.yaml, gone.yaml]\n"
        "tests:\n"
        "  - name: notation\n"
        "    input_series:\n"
        "      - series: 'x{host=\"a\"}'\n"
        "        values: '0 2 2+x3'\n"
        "      - series: 'x{host=a}'\n"
        "        values: '1'\n"
        "  - name: schema\n"
        "    input_seres: []\n"
        "    alerts_at:\n"
        "      ten: []\n"
        "      10: [{rule: high, state: resolved}]\n",
        capsys,
    )
    assert code == 1 and out == "FAILED: 1 file did not load\n"
    assert err.splitlines() == [
        f"T:1:22: field 'rule_files[1]': no such rule file: {tmp_path / 'gone.yaml'}",
        "T:6:22: test 'notation', field 'input_series[0].values': invalid value '2+x3': "
        "expected a number, '_', 'a+bxn', 'a-bxn', 'axn' or '_xn'",
        "T:7:25: test 'notation', field 'input_series[1].series': expected a quoted label value",
        "T:9:5: test 'schema', field 'input_series': missing required field",
        "T:10:5: test 'schema', field 'input_seres': unknown field; did you mean 'input_series'?",
        "T:12:7: test 'schema', field 'alerts_at.ten': expected an integer, got 'ten'",
        "T:13:32: test 'schema', field 'alerts_at.10[0].state': "
        "expected 'pending' or 'firing', got 'resolved'",
    ]


def test_names_in_expectations_must_exist(tmp_path: Path, capsys):
    code, _, err = _run(
        tmp_path,
        "rule_files: [r.yaml]\n"
        "tests:\n"
        "  - name: typos\n"
        "    input_series: [{series: x, values: '1'}]\n"
        "    alerts_at: {0: [{rule: hihg}]}\n"
        "    incidents_at: {0: {family: unattributed, evidence: [mean_hihg]}}\n"
        "    actions_at: {0: [{rule: high, action: halt}]}\n"
        "  - name: typos\n"
        "    input_series: [{series: x, values: '1'}, {series: x, values: '2'}]\n",
        capsys,
    )
    assert code == 1
    assert err.splitlines() == [
        "T:5:28: test 'typos', field 'alerts_at.0[0].rule': no rule named 'hihg' in the rule "
        "files; did you mean 'high'?",
        "T:6:57: test 'typos', field 'incidents_at.0.evidence[0]': no rule named 'mean_hihg' "
        "in the rule files; did you mean 'mean_high'?",
        "T:7:43: test 'typos', field 'actions_at.0[0].action': rule 'high' does not ask for "
        "'halt' (page)",
        "T:8:11: test 'typos', field 'name': duplicate test name; first at T:3:11",
        "T:9:55: test 'typos', field 'input_series[1].series': the same series as input_series[0]",
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("rule_files: [r.yaml\n", "T:2:1: invalid YAML: expected ',' or ']', but got '<stream"),
        (
            "rule_files: [r.yaml]\nrule_files: []\n",
            "T:2:1: field 'rule_files': duplicate key (first at line 1)",
        ),
        ("- 1\n", "T:1:1: expected a mapping with 'rule_files' and 'tests', got a list"),
        ("rule_files: [r.yaml]\ntests: []\n", "T:2:8: field 'tests': List should have at least"),
    ],
)
def test_broken_yaml_is_located(tmp_path: Path, capsys, text: str, error: str):
    code, _, err = _run(tmp_path, text, capsys)
    assert code == 1 and err.startswith(error), err


def test_errors_in_the_rule_files_are_reported_where_they_are(tmp_path: Path, capsys):
    (tmp_path / "bad.yaml").write_text(RULES.replace("above: 1}", "above: one}"))
    path = tmp_path / "t_test.yaml"
    path.write_text(
        "rule_files: ['*.yaml']\ntests: [{name: t, input_series: [{series: x, values: '1'}]}]\n"
    )
    assert main(["test", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bad.yaml'}:6:44: group 'g', rule 'high', field 'detector.above'" in err
    assert "t_test.yaml" not in err  # the glob names the rule files, not the test file


class _Boom:
    """A detector that raises on a value above 5 (a rule that breaks mid-run)."""

    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def update(self, step: int, value: float) -> _Boom:
        if value > 5:
            raise ValueError(f"boom at {step}")
        return self

    triggered = False
    onset_step = direction = statistic = baseline = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def test_a_rule_that_breaks_fails_the_test(tmp_path: Path, capsys):
    (tmp_path / "r.yaml").write_text(RULES.replace("{type: threshold, above: 1}", "{type: boom}"))
    path = tmp_path / "t_test.yaml"
    path.write_text(
        "rule_files: [r.yaml]\ninterval: 5\n"
        "tests: [{name: breaks, input_series: [{series: x, values: '1 9 1'}]}]\n"
    )
    catalog = DetectorCatalog(
        types={**DETECTORS, "boom": _Boom},
        build=lambda name, params: _Boom() if name == "boom" else build_detector(name, params),
    )
    code = cli_test(
        [str(path)], limits_of=lambda request: (PacingLimits(), False), detectors=catalog
    )
    out = capsys.readouterr().out.replace(str(path), "T")
    assert code == 1
    assert out.splitlines()[:3] == [
        "T:3:16: FAILED test 'breaks', step 5, rule high",
        "  expected: no error",
        "  got:      ValueError: boom at 5",
    ]


def test_the_walkthrough_in_docs_rules_md_is_true(tmp_path: Path, capsys):
    """docs/rules.md's rule and test file pass, and its printed outputs are what they print."""
    text = (ROOT / "docs" / "rules.md").read_text(encoding="utf-8")
    yaml_blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    text_blocks = re.findall(r"```text\n(.*?)```", text, re.S)
    (tmp_path / "my_rules.yaml").write_text(yaml_blocks[0])
    (tmp_path / "my_rules_test.yaml").write_text(yaml_blocks[1])
    checked = []
    for block in text_blocks:
        command, *printed = block.splitlines()
        argv = command.removeprefix("$ mechwatch ").split()
        if argv[0] not in ("validate", "explain", "test") or "FAILED" in block:
            continue
        argv = [str(tmp_path / a) if a.startswith("my_rules") else a for a in argv]
        assert main(argv) == 0, command
        out = capsys.readouterr().out.replace(f"{tmp_path}/", "")
        assert out.splitlines() == printed, command
        checked.append(argv[0])
    assert checked == ["validate", "explain", "test"]
