"""`mechwatch validate` and `mechwatch rules` as functions: output and exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.rules import validate

GOOD = """\
groups:
  - name: fa_precision
    rules:
      - name: qk_delta2_entropy_collapse
        metric: qk_delta2_entropy
        reduce: {op: mean, over: [head]}
        detector: {type: baseline, warmup: 6, direction: drop, rel: 0.5}
        severity: critical
        family: fa_precision
        actions: [attention_fp32_backward, {rollback: {margin_steps: 100}}, page]
      - name: custom_metric_rule
        metric: my_metric
        detector: {type: threshold, above: 1}
        severity: info
        family: symptom
        enabled: false
"""


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.yaml"
    path.write_text(GOOD)
    return path


def test_validate_ok_prints_a_summary_and_warnings(good_file: Path, capsys):
    assert validate.cli_validate([str(good_file)]) == 0
    out, err = capsys.readouterr()
    assert out == "OK: 2 rules in 1 group from 1 file, 1 warning\n"
    assert err == (
        f"warning: {good_file}:12:17: group 'fa_precision', rule 'custom_metric_rule', "
        "field 'metric': metric 'my_metric' is not produced by a built-in monitor "
        "(fine if your own code logs it)\n"
    )


def test_validate_prints_every_error_one_per_line(tmp_path: Path, good_file: Path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("rel: 0.5", "rel: abc").replace("severity: info", "severity: low"))
    assert validate.cli_validate([str(good_file), str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        f"{bad}:4:15: group 'fa_precision', rule 'qk_delta2_entropy_collapse', field 'name': "
        f"duplicate rule name 'qk_delta2_entropy_collapse'; first defined at {good_file}:4:15",
        f"{bad}:7:69: group 'fa_precision', rule 'qk_delta2_entropy_collapse', "
        "field 'detector.rel': expected a number, got 'abc'",
        f"{bad}:11:15: group 'fa_precision', rule 'custom_metric_rule', field 'name': "
        f"duplicate rule name 'custom_metric_rule'; first defined at {good_file}:11:15",
        f"{bad}:14:19: group 'fa_precision', rule 'custom_metric_rule', field 'severity': "
        "expected 'info', 'warning' or 'critical', got 'low'",
    ]


def test_validate_uses_the_action_validator(good_file: Path, capsys):
    def only_page(name: str, params: dict) -> None:
        if name != "page":
            raise ValueError(f"unknown action '{name}'")

    assert validate.cli_validate([str(good_file)], action_validator=only_page) == 1
    assert capsys.readouterr().err.splitlines()[:2] == [
        f"{good_file}:10:19: group 'fa_precision', rule 'qk_delta2_entropy_collapse', "
        "field 'actions[0]': unknown action 'attention_fp32_backward'",
        f"{good_file}:10:44: group 'fa_precision', rule 'qk_delta2_entropy_collapse', "
        "field 'actions[1]': unknown action 'rollback'",
    ]


def test_defaults_to_the_shipped_packs(monkeypatch, good_file: Path, capsys):
    monkeypatch.setattr(validate, "default_rule_files", lambda: [])
    assert validate.cli_validate([]) == 1
    assert capsys.readouterr().err == "no rule files given and none shipped in mechwatch_rules\n"
    monkeypatch.setattr(validate, "default_rule_files", lambda: [good_file])
    assert validate.cli_validate([]) == 0
    assert capsys.readouterr().out.startswith("OK: 2 rules in 1 group from 1 file")


def test_list_prints_a_table(good_file: Path, capsys):
    assert validate.cli_list([str(good_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:4] for line in lines] == [
        ["FILE", "GROUP", "RULE", "METRIC"],
        ["good.yaml", "fa_precision", "qk_delta2_entropy_collapse", "qk_delta2_entropy"],
        ["good.yaml", "fa_precision", "custom_metric_rule", "(disabled)"],
    ]
    assert lines[1].endswith(
        "baseline(warmup=6, direction=drop, rel=0.5)  fa_precision  critical  "
        "attention_fp32_backward, rollback(margin_steps=100), page"
    )
    assert lines[2].endswith(
        "threshold(above=1)                           symptom       info      -"
    )


def test_list_fails_like_validate_on_bad_files(tmp_path: Path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups: 3\n")
    assert validate.cli_list([str(bad)]) == 1
    assert capsys.readouterr().err == f"{bad}:1:9: field 'groups': expected a list, got 3\n"
    assert validate.cli_list(["--bogus"]) == 2  # argparse usage error, not an exception
