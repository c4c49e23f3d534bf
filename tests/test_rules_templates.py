"""Summary / suggest templates: load-time checks and a render that never fails."""

from __future__ import annotations

import pytest

from agent.rules.templates import check_template, render_template

VALUES = {
    "value": 0.12345,
    "baseline": None,
    "statistic": -4.5,
    "onset_step": None,
    "fired_step": 1200,
    "step": 1250,
    "rule": "qk",
    "metric": "qk_delta2_entropy",
    "direction": "falling",
    "labels": {"layer": "model.layers.3.self_attn"},
}


def test_render_fills_values_and_shows_missing_ones_as_na():
    template = (
        "{rule}: {labels[layer]} {value:.3f} (baseline {baseline:.3f}, z {statistic:+.1f}) "
        "onset {onset_step:>6} fired {fired_step:,} head {labels[head]} {direction!r}"
    )
    check_template(template)
    assert render_template(template, VALUES) == (
        "qk: model.layers.3.self_attn 0.123 (baseline n/a, z -4.5) "
        "onset n/a fired 1,200 head n/a 'falling'"
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{value.real}", "placeholder '{value.real}' cannot use attributes or indexing"),
        ("{labels}", "placeholder '{labels}' must name one label, like '{labels[layer]}'"),
        (
            "{labels.layer}",
            "placeholder '{labels.layer}' must name one label, like '{labels[layer]}'",
        ),
        ("{value:{width}}", "placeholder '{value}' has a nested placeholder in its spec"),
        (
            "{0}",
            "positional placeholder '{0}' is not allowed; use a name: value, baseline, "
            "statistic, onset_step, fired_step, step, rule, metric, direction, labels[...]",
        ),
        (
            "{rule:d}",
            "bad format spec 'd' for placeholder '{rule}': "
            "Unknown format code 'd' for object of type 'str'",
        ),
        ("}", "invalid template: Single '}' encountered in format string"),
    ],
)
def test_check_template_rejects(template, message):
    with pytest.raises(ValueError) as info:
        check_template(template)
    assert str(info.value) == message


def test_render_never_raises_on_odd_values():
    assert render_template("{value:.2f} {step:d}", {"value": "text", "step": 3.5}) == "text 3.5"
    assert render_template("{oops} {", {}) == "{oops} {"  # unchecked template: shown raw
