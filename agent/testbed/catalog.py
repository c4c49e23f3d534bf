"""The detection benchmark's scenario catalogue: documented test-bed knobs, nothing patched.

Every entry is a ``ScenarioConfig`` built from the knobs of ``agent.testbed.scenarios`` (no
harness patches), with the family a correct agent reports (None: benign, the agent must not
open a mechanism incident) and the group it belongs to:

- ``benign``: clean runs and healthy change: unbiased rounding at 3 and 6 bits on dS and dQK,
  a data shift mid-run (another chain, and a milder one), the learning rate x0.1 (a step
  decay's cut), x0.3 and x2 mid-run, a cosine decay, one-time steps the optimizer does not
  show (a data-mixture flip, a sequence-length step, the batch doubled), a longer warm-up, a
  lower learning rate, a bigger model (4 layers, d 96; also with each one-time step), a GQA
  model, a 3,000-step run;
- ``fa``: biased rounding (floor, ceil, away) at 4-8 mantissa bits on dS and dQK, switched on
  at step 300, 500 or 900, ramped in over 500 steps, in one layer only, in the bigger model;
- ``router``: the router LR x3 / x10 / x30 with the balancing loss on and off, a small batch,
  and both faults at once (``combined``);
- ``sweep``: fault strength (bits) x learning rate, for where the silent phase is.

``twin(config)``: the same run without the fault (same seed, model, data and schedule): the
yardstick of when a fault really degraded the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.testbed.model import TestbedConfig
from agent.testbed.scenarios import ScenarioConfig

BIG = TestbedConfig(n_layers=4, d_model=96, n_heads=4, n_kv_heads=4)
GQA = TestbedConfig(n_heads=4, n_kv_heads=2)
STEPS = 2000


@dataclass(frozen=True)
class Entry:
    """One scenario of the catalogue."""

    name: str
    group: str  # benign | fa | router | sweep
    expected: str | None  # the family a correct agent attributes; None: benign
    scenario: str  # the ScenarioConfig preset
    knobs: dict[str, Any]  # ScenarioConfig fields over the preset

    def config(self, seed: int, *, steps: int | None = None) -> ScenarioConfig:
        fields = dict(self.knobs)
        fields.setdefault("steps", STEPS)
        if steps is not None:
            fields["steps"] = steps
        return ScenarioConfig.preset(self.scenario, seed=seed, **fields)


def _fa(name: str, group: str = "fa", **knobs: Any) -> Entry:
    base = {"fa_sites": ("dS",), "fa_bits": 6, "fa_mode": "floor"}
    return Entry(name, group, "fa_precision", "fa_precision", {**base, **knobs})


def _router(name: str, lr_mult: float, balance_off: bool, **knobs: Any) -> Entry:
    fault = {"router_lr_mult": lr_mult, "fault_balance_coef": 0.0 if balance_off else None}
    return Entry(name, "router", "router_instability", "router_instability", {**fault, **knobs})


def _benign(name: str, scenario: str = "clean", **knobs: Any) -> Entry:
    return Entry(name, "benign", None, scenario, knobs)


# The knobs of the one-time healthy steps the optimizer does not show (at step 900).
STEP_KNOBS: dict[str, dict[str, Any]] = {
    # both chains from the start, their proportions flip at 900 (a data-mixture step)
    "mixture_step": {"shift_step": 900, "shift_fraction": 0.75, "mix_fraction_before": 0.25},
    "seq_len_x4": {"short_seq_len": 16, "short_seq_until": 900},  # a length curriculum's step
    "batch_x2": {"batch_change_step": 900, "batch_change_size": 32, "steps": 1500},  # a ramp
}


CATALOG: tuple[Entry, ...] = (
    _benign("clean"),
    _benign("control_dS_3", "control", fa_sites=("dS",), fa_bits=3),
    _benign("control_dS_6", "control", fa_sites=("dS",), fa_bits=6),
    _benign("control_dQK_3", "control", fa_sites=("dQK",), fa_bits=3),
    _benign("control_dQK_6", "control", fa_sites=("dQK",), fa_bits=6),
    _benign("data_shift", shift_step=900, shift_fraction=1.0),
    _benign("data_shift_mild", shift_step=900, shift_fraction=0.25),
    _benign("mixture_step", **STEP_KNOBS["mixture_step"]),
    _benign("lr_x0.3", lr_change_step=900, lr_change_mult=0.3),
    _benign("lr_x0.1", lr_change_step=900, lr_change_mult=0.1),  # a step decay's cut
    _benign("lr_x2", lr_change_step=900, lr_change_mult=2.0),
    _benign("lr_cosine", lr_cosine_floor=0.1),  # a cosine decay to a tenth
    _benign("seq_len_x4", **STEP_KNOBS["seq_len_x4"]),
    _benign("batch_x2", **STEP_KNOBS["batch_x2"]),
    _benign("warmup_long", warmup_steps=500),
    _benign("lr_low", lr=3e-3),
    _benign("big_model", model=BIG),
    # the one-time healthy steps above in the bigger model, whose QK circuit has phase
    # transitions of its own
    _benign("big_mixture_step", model=BIG, **STEP_KNOBS["mixture_step"]),
    _benign("big_seq_len_x4", model=BIG, **STEP_KNOBS["seq_len_x4"]),
    _benign("big_batch_x2", model=BIG, **STEP_KNOBS["batch_x2"]),
    _benign("gqa_model", model=GQA),
    _benign("clean_3000", steps=3000),
    _fa("fa_floor_4", fa_bits=4),
    _fa("fa_floor_5", fa_bits=5),
    _fa("fa_floor_6"),
    _fa("fa_floor_7", fa_bits=7),
    _fa("fa_floor_8", fa_bits=8),
    _fa("fa_ceil_6", fa_mode="ceil"),
    _fa("fa_away_6", fa_mode="away"),
    _fa("fa_dQK_4", fa_sites=("dQK",), fa_bits=4),
    _fa("fa_dQK_6", fa_sites=("dQK",), fa_bits=6),
    _fa("fa_start_300", fault_start=300),
    _fa("fa_start_900", fault_start=900, steps=2400),
    _fa("fa_ramp", fa_ramp_steps=500),
    # a fault that begins at a step decay's cut: written off as the schedule's consequence
    # (agent/schedule_steps.py), the price of that differential diagnosis
    _fa("fa_at_lr_cut", fault_start=900, lr_change_step=900, lr_change_mult=0.1, steps=2400),
    _fa("fa_one_layer", fa_layers=(1,)),
    _fa("fa_big_model", model=BIG),
    _fa("fa_gqa_model", model=GQA),
    _router("router_x3", 3.0, False),
    _router("router_x10", 10.0, False),
    _router("router_x30", 30.0, False),
    _router("router_x3_nobal", 3.0, True),
    _router("router_x10_nobal", 10.0, True),
    _router("router_x30_nobal", 30.0, True),
    _router("router_small_batch", 3.0, False, fault_batch_size=4),
    Entry(
        "combined",
        "router",
        "combined",
        "combined",
        {"fa_bits": 6, "fa_mode": "floor", "router_lr_mult": 30.0, "fault_balance_coef": 0.0},
    ),
    *(
        _fa(f"sweep_lr{lr:g}_bits{bits}", "sweep", fa_bits=bits, lr=lr)
        for lr in (3e-3, 2e-2)
        for bits in (4, 5, 6, 7, 8)
    ),
    _benign("sweep_lr0.02_clean", lr=2e-2),
)
BY_NAME: dict[str, Entry] = {e.name: e for e in CATALOG}
assert len(BY_NAME) == len(CATALOG), "catalogue names must be unique"

TUNING_SEEDS: tuple[int, ...] = (0, 1)
EVALUATION_SEEDS: tuple[int, ...] = (100, 101, 102, 103)

_FAULT_FREE = {
    "scenario": "clean",
    "fa_ramp_steps": 0,
    "fa_layers": None,
    "router_lr_mult": 1.0,
    "lr_mult": 1.0,
    "fault_batch_size": None,
    "fault_balance_coef": None,
}


def twin(config: ScenarioConfig) -> ScenarioConfig:
    """The same run without its fault: same seed, model, data, schedule and disturbances."""
    return config.model_copy(update=_FAULT_FREE)


# scenario knobs added after twins were first recorded
_LATER_KNOBS = (
    "lr_cosine_floor",
    "batch_change_step",
    "batch_change_size",
    "mix_fraction_before",
    "short_seq_len",
    "short_seq_until",
)


def twin_key(config: ScenarioConfig) -> str:
    """A stable key of a fault-free run (what recordings of twins are named by)."""
    import hashlib
    import json

    fields = twin(config).model_dump(mode="json")
    for name in ("fa_sites", "fa_bits", "fa_mode", "fault_start"):
        fields.pop(name)  # no fault: these do not change the run
    for name in _LATER_KNOBS:  # knobs added since: at their default, the keys stay as they were
        if fields.get(name) is None:
            fields.pop(name, None)
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
