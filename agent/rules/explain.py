"""``mechwatch explain RULE``: what a rule watches, when it fires and resolves, and what it does,
in plain words, from the loaded rule (so it says what the engine will do, defaults included).

    $ mechwatch explain routing_entropy_collapse
    routing_entropy_collapse  (rules/router.yaml:9, group router_instability)
      watches   router_entropy_norm (every series; one alert per router) ...

Pacing (cooldowns, caps, once per episode) comes from a ``Pacing`` policy built the way the
agent builds it, so the words match what ``remediations.pacing`` will decide.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from agent.rules.detector_words import describe_detector, levels
from agent.rules.errors import RuleFileErrors
from agent.rules.loader import ActionValidator, default_rule_files, load_rule_files
from agent.rules.ruleset import Rule, RuleSet
from agent.rules.schema import ActionSpec, ClearSpec, Duration, RequiresSpec
from remediations.pacing import ActionRequest, LimitsOf, Pacing

WIDTH = 100
# The labels the built-in monitors put on a metric (agent/samples.py, agent/probes.py) and
# how often the agent measures it: what "one evaluation" and "one alert per ..." mean.
_QK = "every qk.delta steps (25)"
_ROUTER = "every router.every steps (25)"
KNOWN_METRICS: dict[str, tuple[tuple[str, ...], str]] = {
    **dict.fromkeys(
        (
            "qk_delta1_entropy",
            "qk_delta2_entropy",
            "qk_delta3_entropy",
            "qk_delta2_stable_rank",
            "qk_delta2_frobenius",
            "qk_delta2_persistence",
            "dwq_entropy",
            "wq_spectral_norm",
        ),
        (("layer", "head"), _QK),
    ),
    **dict.fromkeys(("dwk_entropy", "wk_spectral_norm"), (("layer", "kv_head"), _QK)),
    **dict.fromkeys(
        ("control_update_entropy", "control_update_rel_norm"), (("layer", "param"), _QK)
    ),
    **dict.fromkeys(
        (
            f"router_{name}"
            for name in (
                "entropy",
                "entropy_norm",
                "entropy_p10",
                "eps",
                "similarity",
                "load_max",
                "load_entropy",
                "margin",
                "dead_experts",
                "update_rel_norm",
                "block_update_rel_norm",
                "update_ratio",
            )
        ),
        (("router",), _ROUTER),
    ),
    **dict.fromkeys(("loss", "loss_nonfinite", "grad_norm"), ((), "every step")),
    "seconds_since_step": ((), "every watchdog.check_every_s seconds (30)"),
    "lr": (("group",), "every symptoms.every steps (10), when the agent has the optimizer"),
}

FAMILY_WORDS = {
    "fa_precision": "evidence of a biased low-precision attention backward (fa_precision)",
    "router_instability": "evidence of an MoE router collapse (router_instability)",
    "symptom": "a symptom (loss, gradient norm, NaN, hung run): it opens an unattributed "
    "incident on its own and corroborates a mechanism's",
}


def explain_rule(
    rule: Rule,
    pacing: Pacing | None = None,
    action_doc: Callable[[str], str] | None = None,
) -> list[str]:
    """The lines of the explanation of ``rule`` (wrapped at ``WIDTH``)."""
    head = f"{rule.name}  ({rule.source}, group {rule.group})"
    if not rule.enabled:
        head += "  DISABLED: never evaluated"
    rows = [
        ("watches", _watches(rule)),
        ("detector", f"{rule.detector.type}: {_detector_words(rule)}."),
        *[
            ("unless" if veto else "requires", _second_signal(spec, veto))
            for spec, veto in rule.second_signals
        ],
        ("timing", _timing(rule)),
        ("means", f"{FAMILY_WORDS.get(rule.family, rule.family)}; severity {rule.severity}."),
    ]
    lines = [head]
    for title, text in rows:
        lines += textwrap.wrap(
            text, WIDTH, initial_indent=f"  {title:<9} ", subsequent_indent=" " * 12
        )
    lines += _actions(rule, pacing, action_doc)
    return lines


def _detector_words(rule: Rule) -> str:
    return describe_detector(rule.detector.type, rule.detector.params)


def _second_signal(req: RequiresSpec, veto: bool) -> str:
    words = describe_detector(req.detector.type, req.detector.params)
    if req.within == 0:
        when = "at the same step"
    elif req.every:
        when = f"at every one of its evaluations within the last {req.within} steps"
    else:
        when = f"within the last {req.within} steps"
    if req.reduce is None:
        selection = "the same series selection, per the same labels"
    else:
        op = f"quantile {req.reduce.q:g}" if req.reduce.op == "quantile" else req.reduce.op
        over = "all of them" if req.reduce.over is None else ", ".join(req.reduce.over)
        selection = (
            f"the same series selection, the {op} over {over} at each step; "
            "the labels it keeps must agree with the alert's"
        )
    lead = "but not while" if veto else "and only while"
    return f"{lead} {req.metric} ({selection}) triggered {req.detector.type} {when}: {words}."


def _watches(rule: Rule) -> str:
    labels, cadence = KNOWN_METRICS.get(rule.metric, ((), ""))
    match = rule.matcher.as_mapping()
    which = (
        "the series whose " + ", ".join(f"{k} matches {v!r}" for k, v in match.items())
        if match
        else "every series"
    )
    reduce = rule.reduce
    if reduce is None:
        per = f"one alert per {', '.join(labels)}" if labels else "one alert"
        shape = f"each series on its own ({per})"
    else:
        kept = [] if reduce.over is None else [k for k in labels if k not in reduce.over]
        op = f"quantile {reduce.q:g}" if reduce.op == "quantile" else reduce.op
        over = "all of them" if reduce.over is None else ", ".join(reduce.over)
        per = f"one alert per {', '.join(kept)}" if kept else "one alert"
        shape = f"the {op} over {over} at each step ({per})"
    measured = f"; the agent measures it {cadence}" if cadence else ""
    return f"{rule.metric}: {which}, {shape}{measured}. One evaluation is one value of it."


def _count(duration: Duration) -> str:
    if duration.unit == "steps":
        return f"{duration.count} training steps"
    return f"{duration.count} evaluation{'' if duration.count == 1 else 's'}"


def _timing(rule: Rule) -> str:
    parts = []
    if rule.spec.start_step:
        parts.append(
            f"Looks at values from step {rule.spec.start_step} on (earlier ones are ignored)"
        )
    fires = (
        "fires at the first evaluation that meets the condition"
        if rule.for_.count == 0
        else f"fires once the condition has held for {_count(rule.for_)} after it became pending"
    )
    parts.append(fires[0].upper() + fires[1:] if not parts else fires)
    keep = rule.keep_firing_for
    stop = (
        "resolves at the first evaluation without the condition"
        if keep.count == 0
        else f"resolves once more than {_count(keep)} passed without the condition"
    )
    if rule.clear is not None:
        stop += f", and only while {_clear_words(rule.clear)}"
    parts.append(stop)
    return "; ".join(parts) + "."


def _clear_words(clear: ClearSpec) -> str:
    ratio = clear.baseline_ratio_above, clear.baseline_ratio_below
    words = [f"the value is {w}" for w in levels(clear.above, clear.below)]
    words += [f"the value is {w} of the baseline" for w in levels(*ratio, fmt="{:.0%}")]
    return " and ".join(words)


def _actions(
    rule: Rule, pacing: Pacing | None, action_doc: Callable[[str], str] | None
) -> list[str]:
    if not rule.actions:
        return ["  actions   none (the incident is still paged through the notifiers)."]
    lines = ["  actions   in this order, when the rule starts firing:"]
    for i, action in enumerate(rule.actions, 1):
        text = f"{i}. {_action_name(action)}"
        doc = action_doc(action.name) if action_doc is not None else ""
        if doc:
            text += f": {doc.rstrip('.')}"
        if pacing is not None:
            text += f". {_pacing_words(rule, action, pacing)}"
        lines += textwrap.wrap(
            text + ".", WIDTH, initial_indent=" " * 12, subsequent_indent=" " * 15
        )
    return lines


def _action_name(action: ActionSpec) -> str:
    if not action.params:
        return action.name
    inner = ", ".join(f"{k}: {v}" for k, v in action.params.items())
    return f"{action.name} {{{inner}}}"


def _pacing_words(rule: Rule, action: ActionSpec, pacing: Pacing) -> str:
    request = ActionRequest(None, rule.name, action.name, dict(action.params))
    limits, repeats = pacing.limits(request)
    if "cooldown" in action.params:
        source = "its own cooldown"
    elif repeats and rule.cooldown is not None:
        source = "the rule's cooldown"
    else:
        source = "the action's default cooldown"
    if repeats and limits.cooldown > 0:
        when = f"Runs again every {limits.cooldown} steps while the rule keeps firing ({source})"
    else:
        when = "Runs once each time the rule starts firing"
    if limits.max_per_window < limits.window_steps:  # else no cap: one run per step at most
        beyond = "then pages and halts the run (escalate)"
        beyond = beyond if limits.on_limit == "escalate" else "then is skipped"
        when += f"; at most {limits.max_per_window} runs per {limits.window_steps} steps, {beyond}"
    if limits.dry_run:
        when += "; dry run: records what it would do, changes nothing"
    return when


# ----------------------------------------------------------------------------- the command


def cli_explain(
    argv: list[str],
    *,
    limits_of: LimitsOf | None = None,
    action_doc: Callable[[str], str] | None = None,
    action_validator: ActionValidator | None = None,
) -> int:
    parser = argparse.ArgumentParser(
        prog="mechwatch explain", description="Say in plain words what rules watch and do."
    )
    parser.add_argument("rules", nargs="+", metavar="RULE", help="rule names")
    parser.add_argument(
        "--rules",
        dest="files",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="rule files or directories (default: the shipped rule packs)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        ruleset = load_rule_files(args.files or default_rule_files(), action_validator)
    except RuleFileErrors as e:
        for error in e.errors:
            print(error, file=sys.stderr)
        return 1
    pacing = _pacing(ruleset, limits_of) if limits_of is not None else None
    code = 0
    for i, name in enumerate(args.rules):
        rule = ruleset.get(name)
        if rule is None:
            close = difflib.get_close_matches(name, [r.name for r in ruleset], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            print(f"mechwatch explain: no rule named '{name}'{hint}", file=sys.stderr)
            code = 1
            continue
        print(("\n" if i else "") + "\n".join(explain_rule(rule, pacing, action_doc)))
    return code


def _pacing(ruleset: RuleSet, limits_of: LimitsOf) -> Pacing:
    """Pacing as the agent builds it (its rule cooldowns), asked only for limits."""
    cooldowns = {r.name: r.cooldown for r in ruleset}
    return Pacing(limits_of, rule_cooldowns=cooldowns)
