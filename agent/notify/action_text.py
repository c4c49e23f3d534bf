"""What an action did, as a sentence: "switched the attention backward to FP32 for every
layer", "rolled back from step 730 to the checkpoint of step 600 (onset 675, margin 50)",
"lowered the LR x0.1 on param group 1 (0.003 → 0.0003)".

Driven by an action's record (its name, ``detail``, ``before``/``after`` values, dry run, ok):
one small formatter per built-in action; any other action (a user's, or a record a formatter
cannot read) falls back to its ``detail`` and the values that changed, written compactly. A
failed action is its ``detail`` (the runner puts the error there). Shared by pages
(``agent.notify.page_lines``), the demo's summary and ``mechwatch report``.

>>> action_sentence("rollback", "", {"step": 730, "onset_step": 675},
...                 {"step": 600, "discarded_steps": [700]})
'rolled back from step 730 to the checkpoint of step 600 (onset 675); deleted the newer \
checkpoint of step 700'
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.incidents import ActionRecord

Values = Mapping[str, Any]
Formatter = Callable[[Values, Values, bool, str], "str | None"]  # None: cannot read the record
_MARGIN = re.compile(r"\bmargin (\d+)\b")
_MAX_VALUE_TEXT = 80


def action_sentence(
    action: str,
    detail: str,
    before: Values | None,
    after: Values | None,
    *,
    dry_run: bool = False,
    ok: bool = True,
) -> str:
    """One sentence for what ``action`` did (or would do, in a dry run)."""
    if not ok:
        return detail or f"{action} failed"
    formatter = _FORMATTERS.get(action)
    sentence = None
    if formatter is not None:
        try:
            sentence = formatter(before or {}, after or {}, dry_run, detail)
        except (TypeError, ValueError, KeyError, ZeroDivisionError):
            sentence = None  # a record of another shape: say it the generic way
    return sentence if sentence is not None else _generic(action, detail, before, after)


def record_sentence(record: ActionRecord) -> str:
    """``action_sentence`` of an incident's action record."""
    return action_sentence(
        record.action,
        record.detail,
        record.before,
        record.after,
        dry_run=record.dry_run,
        ok=record.ok,
    )


# ----------------------------------------------------------------------------- built-ins


def _verb(dry: bool, done: str, would: str) -> str:
    return would if dry else done


def _attention(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    old, new = before.get("precision"), after.get("precision")
    if not isinstance(new, Mapping):
        return None
    old = old if isinstance(old, Mapping) else {}
    added = sorted(set(new.get("included") or []) - set(old.get("included") or []))
    if new.get("all") and not old.get("all"):
        where = "for every layer"
    elif added:
        where = f"for {_layers(added)}"
    else:
        where = "for every layer" if new.get("all") else f"for {_layers(new.get('included'))}"
        return f"the attention backward was already FP32 {where}"
    excluded = new.get("excluded") or []
    if excluded:
        where += f" except {_layers(excluded)}"
    return f"{_verb(dry, 'switched', 'would switch')} the attention backward to FP32 {where}"


def _layers(names: Sequence[str] | None) -> str:
    names = list(names or [])
    if len(names) == 1:
        return f"layer {names[0]}"
    return f"layers {', '.join(names)}" if names else "no layer"


def _rollback(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    to, origin = after.get("step"), before.get("step")
    if after.get("escalate"):
        return detail or None  # a dry run found no usable checkpoint: the detail says why
    if not isinstance(to, int) or not isinstance(origin, int):
        return None
    why = []
    if before.get("onset_step") is not None:
        why.append(f"onset {before['onset_step']}")
    margin = before.get("margin_steps")
    found = _MARGIN.search(detail)
    if margin is None and found is not None:
        margin = int(found.group(1))
    if margin is not None:
        why.append(f"margin {margin}")
    verb = _verb(dry, "rolled back", "would roll back")
    text = f"{verb} from step {origin} to the checkpoint of step {to}"
    text += f" ({', '.join(why)})" if why else ""
    skipped = after.get("skipped_batches")
    if skipped:
        text += f", skipping {skipped} batches"
    discarded = after.get("discarded_steps") or []
    if discarded:
        plural = "s" if len(discarded) > 1 else ""
        steps = ", ".join(str(s) for s in discarded)
        text += f"; deleted the newer checkpoint{plural} of step{plural} {steps}"
    unusable = after.get("skipped_checkpoints") or []
    if unusable:
        text += (
            f"; passed over {len(unusable)} unusable checkpoint{'s' if len(unusable) > 1 else ''}"
        )
    return text


def _lower_lr(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    old, new = list(before["lr_scale"]), list(after["lr_scale"])
    if len(old) != len(new):
        return None
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    if not changed:
        return "left the learning rate as it was"
    factors = {round(new[i] / old[i], 6) for i in changed}
    if len(factors) != 1:
        return None
    factor = factors.pop()
    groups = "every param group" if len(changed) == len(new) > 1 else _groups(changed)
    verb = ("lowered", "would lower") if factor < 1 else ("raised", "would raise")
    text = f"{_verb(dry, *verb)} the LR x{factor:.3g} on {groups}"
    lrs_old, lrs_new = before.get("lr"), after.get("lr")
    if isinstance(lrs_old, list) and isinstance(lrs_new, list) and len(lrs_new) == len(new):
        moves = {(_number(lrs_old[i]), _number(lrs_new[i])) for i in changed}
        if len(moves) == 1:
            text += " ({} → {})".format(*moves.pop())
    if factor > 1 and "relax" in detail:
        text += ", relaxing an earlier cut that overshot"
    if after.get("relax_if"):
        text += f"; relaxed once by half if {after['relax_if']}"
    return text


def _groups(indices: list[int]) -> str:
    if len(indices) == 1:
        return f"param group {indices[0]}"
    return f"param groups {', '.join(str(i) for i in indices)}"


def _halt(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    if "mode" not in after:
        return None
    how = "raises TrainingHalted" if after["mode"] == "raise" else "sets should_stop"
    verb = _verb(dry, "halted the run", "would halt the run")
    text = f"{verb} at step {after.get('step')} (the loop {how})"
    checkpoint = after.get("checkpoint")
    if checkpoint and checkpoint != "none":
        text += f"; final checkpoint: {checkpoint}"
    return text + (f"; reason: {after['reason']}" if after.get("reason") else "")


def _page(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    severity = after.get("severity")
    text = _verb(dry, "paged", "would page") + (f" ({severity})" if severity else "")
    return text + (f": {after['message']}" if after.get("message") else "")


def _request(before: Values, after: Values, dry: bool, detail: str) -> str | None:
    if len(after) != 1:
        return None
    ((name, value),) = after.items()
    was = before.get(name)
    text = f"{_verb(dry, 'requested', 'would request')} {name} = {_number(value)}"
    text += f" (was {_number(was)})" if was is not None else " (not set before)"
    return text + (" [at its cap]" if "at cap" in detail else "")


_FORMATTERS: dict[str, Formatter] = {
    "attention_fp32_backward": _attention,
    "rollback": _rollback,
    "lower_lr": _lower_lr,
    "halt": _halt,
    "page": _page,
    "request_hparam": _request,
    "raise_balance_coef": _request,
    "raise_grad_accum": _request,
}


# ----------------------------------------------------------------------------- fallback


def _number(x: Any) -> str:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def _compact(value: Any) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _number(value)
    text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
    return text if len(text) <= _MAX_VALUE_TEXT else text[: _MAX_VALUE_TEXT - 1] + "…"


def _generic(action: str, detail: str, before: Values | None, after: Values | None) -> str:
    """A user's action: its own description and what changed (key: before → after)."""
    before, after = before or {}, after or {}
    changes = [
        f"{key}: {_compact(before[key]) if key in before else 'unset'} → {_compact(after[key])}"
        for key in sorted(after)
        if before.get(key) != after[key]
    ]
    text = detail or f"ran {action}"
    return text + (f" ({'; '.join(changes)})" if changes else "")
