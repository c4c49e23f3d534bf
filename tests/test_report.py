"""`mechwatch report RUN_DIR`: the timeline read from an event log (rollbacks split the kept and
the abandoned path), labels that never overlap, and a self-contained HTML report of a real
test-bed run whose figures decode as PNG and render in a headless browser."""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.cli import main
from agent.report.markers import Mark, draw_marks, merge_marks, text_extent
from agent.report.timeline import build_timeline, place_of
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import default_agent_config, run_supervised

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A rule that fires early on the tiny test bed (its loss falls below 3.6 by step 16) and rolls
# back to step 0: after two rollbacks the loop guard pages and halts the run at step 30.
RULES = """\
groups:
  - name: report_test
    rules:
      - name: loss_low
        metric: loss
        detector: {type: threshold, below: 3.6}
        for: 2
        keep_firing_for: 3
        severity: critical
        family: symptom
        actions: [{rollback: {margin_steps: 0}}, page]
        cooldown: 30
"""


def _metrics(step: int, *samples: tuple[int, str, dict, object]) -> dict:
    return {"kind": "metrics", "step": step, "samples": [list(s) for s in samples]}


def _rollback(origin: int, to: int) -> dict:
    return {
        "kind": "action",
        "step": origin,
        "action": "rollback",
        "restores_run": True,
        "status": "applied",
        "before": {"step": origin},
        "after": {"step": to},
    }


def test_rollbacks_split_the_kept_path_from_the_abandoned_ones():
    def qk(step: int, value: float) -> dict:
        heads = [
            (step, "qk", {"layer": "L0", "head": h}, value + d) for h, d in (("0", 1), ("1", -1))
        ]
        return _metrics(step, *heads)

    events = [
        {"kind": "start", "run": "r", "attention_layers": ["L0"], "routers": [], "rules": []},
        *(qk(s, float(s)) for s in (10, 20, 30, 40)),
        _rollback(40, 20),  # back to 20: 30 and 40 are abandoned
        *(qk(s, 100.0 + s) for s in (30, 40, 50)),
        _rollback(50, 10),  # back to 10: the new 30..50 and the old 20 are abandoned too
        qk(20, 200.0),
        _metrics(30, (30, "loss", {}, "nan")),
    ]
    timeline = build_timeline(events)
    path = timeline.series["qk"]["L0"]  # the mean over the two heads
    assert path.kept == [(10, 10.0), (20, 200.0)]
    assert path.abandoned == [
        [(20, 20.0), (30, 30.0), (40, 40.0)],
        [(30, 130.0), (40, 140.0), (50, 150.0)],
    ]
    assert [(r.from_step, r.to_step) for r in timeline.rollbacks] == [(40, 20), (50, 10)]
    assert timeline.series["loss"][""].kept[0][1] != timeline.series["loss"][""].kept[0][1]  # NaN
    assert place_of({"layer": "L0", "kv_head": "1", "param": "v"}) == "L0"


def test_alert_episodes_and_what_they_belong_to():
    def alert(step: int, transition: str, **extra: object) -> dict:
        return {
            "kind": "alert",
            "step": step,
            "rule": "r",
            "labels": {"layer": "L0"},
            "transition": transition,
            "value": "nan",
            "baseline": 2.0,
            "onset_step": 5,
            **extra,
        }

    events = [
        alert(10, "inactive->pending"),
        alert(10, "pending->inactive"),
        alert(20, "inactive->pending"),
        alert(30, "pending->firing"),
        alert(50, "firing->inactive"),
        alert(60, "inactive->pending"),
        {
            "kind": "incident",
            "step": 30,
            "event": "opened",
            "message": "",
            "incident": {
                "id": "i1",
                "family": "fa_precision",
                "evidence": [{"rule": "r", "metric": "qk"}],
            },
        },
    ]
    timeline = build_timeline(events)
    first, second, third = timeline.alerts
    assert (first.pending_step, first.end_step, first.cancelled) == (10, 10, True)
    assert (second.fired_step, second.end_step, second.cancelled) == (30, 50, False)
    assert (third.pending_step, third.fired_step, third.end_step) == (60, None, None)
    assert second.baseline == 2.0 and second.place == "L0" and second.value != second.value
    assert timeline.rule_metrics == {"r": "qk"} and list(timeline.incidents) == ["i1"]


def test_marker_labels_never_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(8, 4))
    for ax in axes:
        ax.plot([0, 1500], [0, 1])
    title = axes[0].set_title("a panel title on the left", loc="left", fontsize=8)
    fig.tight_layout()
    steps = [0, 5, 10, 500, 505, 507, 510, 600, 730, 730, 730, 740, 755, 1490, 1500]
    marks = [Mark(s, f"event at step {s}", "green") for s in steps]
    labels = draw_marks(axes, marks, avoid=[title])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [text_extent(label) for label in labels]
    assert len(labels) == 13  # one label per step: the three marks at 730 share one
    assert labels[8].get_text() == "event at step 730"  # the same text once
    assert merge_marks([Mark(7, "a", "red"), Mark(7, "b", "blue")]) == [Mark(7, "a\nb", "red")]
    for i, box in enumerate(boxes):
        assert not box.overlaps(title.get_window_extent(renderer)), (box, title)
        for other in boxes[i + 1 :]:
            assert not box.overlaps(other), (box, other)
    plt.close(fig)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run of the tiny test bed with the agent, two rollbacks and a halt, reported."""
    root = tmp_path_factory.mktemp("report")
    (root / "rules.yaml").write_text(RULES)
    config = default_agent_config(
        root / "run",
        rules=[str(root / "rules.yaml")],
        checkpoints={"enabled": True, "every": 20, "keep_last": 5, "keep_known_good": 3},
    )
    scenario = ScenarioConfig.preset("clean", seed=0, steps=120, scale="tiny")
    result = run_supervised(scenario, config)
    assert result.halted and result.rolled_back_steps == 50  # 20 + 30 steps abandoned
    assert main(["report", str(root / "run")]) == 0
    return root / "run"


def test_the_report_is_self_contained_and_its_figures_are_pngs(report: Path):
    html = (report / "report.html").read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    sources = re.findall(r'src="([^"]*)"', html)
    assert len(sources) >= 3 and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"<script|<link|@import|url\(|https?://", html, re.IGNORECASE)
    from matplotlib.image import imread

    for source in sources:
        png = base64.b64decode(source.removeprefix("data:image/png;base64,"), validate=True)
        assert png.startswith(PNG_SIGNATURE)
        height, width = imread(io.BytesIO(png), format="png").shape[:2]
        assert width > 400 and height > 150
    assert (report / "report.png").read_bytes().startswith(PNG_SIGNATURE)


def test_the_report_tells_what_happened_in_order(report: Path):
    html = (report / "report.html").read_text(encoding="utf-8")
    timeline = html[html.index("<h2>Timeline") : html.index("<h2>", html.index("<h2>Timeline") + 1)]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td></tr>", timeline)
    texts = [text for _, _, text in rows]
    first_rollback = texts.index(
        "rollback: rolled back from step 20 to the checkpoint of step 0 (onset 14, margin 0)"
    )
    assert texts[first_rollback + 1] == "the run continues from step 0; steps 1-20 are abandoned"
    assert rows[first_rollback + 2][0] == "0"  # then the steps go back: the log's order is kept
    assert texts[-1].startswith("halt: halted the run at step 30 (the loop raises TrainingHalted)")
    assert "rollback: escalated: 2 runs of rollback" in texts[-2]
    assert html.count("<details>") == len(
        re.findall(r'"kind": "page"', (report / "events.jsonl").read_text())
    )
    assert "unattributed</span> incident <code>testbed-1-s20</code>" in html


def test_the_report_command_says_what_is_missing(tmp_path: Path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"mechwatch report: no event log at {tmp_path / 'events.jsonl'}\n"
    )


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on this machine")
def test_the_report_renders_in_a_headless_browser_with_its_figures(report: Path, tmp_path: Path):
    """The screenshot shows the figures: their lines' colours are painted (an image that did
    not decode leaves only the page's text and table colours)."""
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1280,2000",
            f"--screenshot={shot}",
            (report / "report.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    from matplotlib.image import imread

    pixels = imread(str(shot))[..., :3]
    blue = abs(pixels - [31 / 255, 119 / 255, 180 / 255]).max(axis=-1) < 0.08  # tab:blue
    orange = abs(pixels - [1.0, 127 / 255, 14 / 255]).max(axis=-1) < 0.08  # tab:orange
    assert blue.sum() > 300 and orange.sum() > 100, (blue.sum(), orange.sum())
