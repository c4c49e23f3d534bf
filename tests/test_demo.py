"""`mechwatch demo`, shortened, end to end: it trains, writes the event log, the summary, the
picture and the report (``mechwatch report``), and prints the summary."""

from __future__ import annotations

import json

from agent.cli import main


def test_short_demo_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(["demo", "--steps", "120", "--fault-start", "60", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scenario"] == "fa_precision" and summary["steps"] == 120
    assert summary["fault_start"] == 60
    assert summary["final_loss"] < 5.0  # it trained (the loss starts near ln 256 = 5.5)
    assert (out / "report.png").stat().st_size > 10_000
    report = (out / "report.html").read_text(encoding="utf-8")
    assert report.startswith("<!DOCTYPE html>") and "data:image/png;base64," in report
    assert "mechwatch report: run testbed" in report
    assert (out / "report_overview.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "agent" / "events.jsonl").exists()
    printed = capsys.readouterr().out
    assert "== summary ==" in printed and "first alert at step" in printed
    assert "(dS floored to 7 mantissa bits)" in printed  # the default fault: bf16's width
    assert f"report:    {out / 'report.html'}" in printed
