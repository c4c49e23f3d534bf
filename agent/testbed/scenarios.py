"""Scenario configuration: one seeded training run of the test bed, with or without a fault.

Scenarios (the fault is switched on at ``fault_start``; every scenario trains identically
before it, so a run has a healthy start):

- ``clean``: no fault.
- ``fa_precision``: the attention backward rounds ``fa_sites`` to ``fa_bits`` mantissa bits
  with the *biased* rounding ``fa_mode`` (floor, ceil, trunc or away).
- ``control``: the same sites and bits with unbiased round-to-nearest-even: the control arm
  of ``fa_precision``, which must stay healthy (the bias is the fault, not the precision).
- ``router_instability``: the router learning rate is multiplied by ``router_lr_mult`` (all
  learning rates by ``lr_mult``), the batch shrinks to ``fault_batch_size`` and the
  balancing loss weight becomes ``fault_balance_coef``.
- ``combined``: both faults at once.

Benign disturbances, on any scenario (healthy change the agent must not take for a fault):
``shift_step`` (from then on ``shift_fraction`` of each batch's sequences come from another
Markov chain, ``shift_data_seed``: 1.0 a full data shift, less a milder one; with
``mix_fraction_before`` that share before it: a mixture that changes its proportions),
``lr_change_step``
(every learning rate times ``lr_change_mult`` from then on), ``lr_cosine_floor`` (a cosine
decay of every learning rate after the warm-up), ``batch_change_step`` (the batch becomes
``batch_change_size`` sequences from then on: a batch-size ramp's step), ``short_seq_len``
(sequences of that length until ``short_seq_until``: a sequence-length curriculum's step), and
the usual knobs
(a longer ``warmup_steps``, a lower ``lr``, a bigger ``model``, GQA through
``model.n_kv_heads``).

Shapes of the FA fault: ``fa_layers`` (only these attention layers; None = all) and
``fa_ramp_steps`` (the share of faulty steps grows linearly from 0 at ``fault_start`` to 1 at
``fault_start + fa_ramp_steps``; which steps are faulty follows a fixed low-discrepancy
sequence of the step index, so a rollback replays the same ones).

``ScenarioConfig.preset(name, seed=..., steps=...)`` returns the documented defaults
(docs/testbed.md has the measurements behind them); ``scale="tiny"`` gives a shortened
version (a smaller model, 400 steps, fault at 150, a stronger FA knob because the run is
short) that runs in a few seconds, used by the test suite and the demo.
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent.testbed.attention import FAULT_SITES, AttentionFault
from agent.testbed.lowprec import UNBIASED_MODES, RoundingMode
from agent.testbed.model import TestbedConfig

ScenarioName = Literal["clean", "control", "fa_precision", "router_instability", "combined"]
SCENARIOS: tuple[str, ...] = get_args(ScenarioName)
FA_SCENARIOS = frozenset({"control", "fa_precision", "combined"})
ROUTER_SCENARIOS = frozenset({"router_instability", "combined"})


class ScenarioConfig(BaseModel):
    """Everything that defines one test-bed run. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- the run
    scenario: ScenarioName = Field("clean", description="which fault, if any")
    seed: int = Field(0, description="model init and batch sampling seed")
    steps: int = Field(2000, ge=1, description="optimizer steps")
    model: TestbedConfig = Field(default_factory=TestbedConfig, description="model shape")
    # --- data (the same Markov chain for every seed, so that seeds are comparable)
    data_seed: int = Field(1234, description="seed of the Markov chain itself")
    markov_order: int = Field(2, ge=1, description="tokens of context that set the next token")
    markov_pool: int = Field(16, ge=1, description="candidate successors per last token")
    markov_branching: int = Field(4, ge=1, description="successors per full context")
    # --- optimization (AdamW, linear warm-up then constant)
    batch_size: int = Field(16, ge=1, description="sequences per step (healthy)")
    lr: float = Field(1e-2, gt=0, description="peak learning rate of every parameter group")
    warmup_steps: int = Field(100, ge=0, description="linear warm-up steps")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="global grad-norm clip; None = off")
    # --- measurement
    monitor_every: int = Field(50, ge=1, description="monitor cadence = snapshot interval, steps")
    # --- faults
    fault_start: int = Field(500, ge=0, description="first step with the fault switched on")
    fa_sites: tuple[str, ...] = Field(("dS",), description=f"rounded sites, from {FAULT_SITES}")
    fa_bits: int = Field(5, ge=0, le=23, description="mantissa bits kept at the fault sites")
    fa_mode: RoundingMode = Field("floor", description="rounding mode (rne = unbiased control)")
    router_lr_mult: float = Field(1.0, gt=0, description="router LR multiplier under the fault")
    lr_mult: float = Field(1.0, gt=0, description="all-groups LR multiplier under the fault")
    fault_batch_size: int | None = Field(None, ge=1, description="batch under the fault")
    fault_balance_coef: float | None = Field(
        None, ge=0, description="balancing loss weight under the fault (None = unchanged)"
    )
    fa_layers: tuple[int, ...] | None = Field(
        None, description="attention layers the FA fault rounds in (None = every layer)"
    )
    fa_ramp_steps: int = Field(
        0, ge=0, description="steps over which the share of faulty steps grows to 1 (0 = at once)"
    )
    # --- benign disturbances
    shift_step: int | None = Field(
        None, ge=0, description="first step whose batches come (in part) from another chain"
    )
    shift_data_seed: int = Field(4321, description="seed of the chain the data shifts to")
    shift_fraction: float = Field(
        1.0, gt=0, le=1, description="share of each batch's sequences from the other chain"
    )
    mix_fraction_before: float | None = Field(
        None,
        gt=0,
        le=1,
        description="share of each batch's sequences from the other chain before shift_step "
        "(None: none; a data mixture that changes its proportions at shift_step)",
    )
    short_seq_len: int | None = Field(
        None, ge=2, description="sequence length before short_seq_until (a length curriculum)"
    )
    short_seq_until: int | None = Field(
        None, ge=0, description="first step with full-length sequences (model.seq_len)"
    )
    lr_change_step: int | None = Field(
        None, ge=0, description="first step at which every LR is multiplied by lr_change_mult"
    )
    lr_change_mult: float = Field(1.0, gt=0, description="the LR multiplier from lr_change_step")
    batch_change_step: int | None = Field(
        None, ge=0, description="first step with batch_change_size sequences per step (healthy)"
    )
    batch_change_size: int | None = Field(
        None, ge=1, description="the batch from batch_change_step on (a batch-size ramp's step)"
    )
    lr_cosine_floor: float | None = Field(
        None,
        gt=0,
        le=1,
        description="a cosine decay of every LR after the warm-up, to this fraction of it at "
        "the last step (None: a constant LR)",
    )

    @model_validator(mode="after")
    def _check(self) -> ScenarioConfig:
        if self.scenario == "control" and self.fa_mode not in UNBIASED_MODES:
            raise ValueError(
                f"scenario 'control' needs unbiased rounding (fa_mode 'rne'), got {self.fa_mode!r}"
            )
        if self.scenario in ("fa_precision", "combined") and self.fa_mode in UNBIASED_MODES:
            raise ValueError(
                f"scenario {self.scenario!r} needs a biased fa_mode, got {self.fa_mode!r} "
                "(unbiased rounding is the 'control' scenario)"
            )
        AttentionFault(sites=self.fa_sites, bits=self.fa_bits, mode=self.fa_mode)  # validates
        if self.fa_layers is not None and not all(
            0 <= i < self.model.n_layers for i in self.fa_layers
        ):
            raise ValueError(
                f"fa_layers {self.fa_layers} must be layer indices in 0..{self.model.n_layers - 1}"
            )
        if self.markov_branching > self.markov_pool:
            raise ValueError(
                f"markov_branching ({self.markov_branching}) must be <= markov_pool "
                f"({self.markov_pool})"
            )
        return self

    @property
    def has_fa_fault(self) -> bool:
        return self.scenario in FA_SCENARIOS

    @property
    def has_router_fault(self) -> bool:
        return self.scenario in ROUTER_SCENARIOS

    def attention_fault(self) -> AttentionFault:
        return AttentionFault(sites=self.fa_sites, bits=self.fa_bits, mode=self.fa_mode)

    def fa_faulty(self, step: int) -> bool:
        """Whether the FA fault rounds the backward of ``step`` (its scenario has one)."""
        if not self.has_fa_fault or step < self.fault_start:
            return False
        if self.fa_ramp_steps == 0:
            return True
        share = min(1.0, (step - self.fault_start + 1) / self.fa_ramp_steps)
        return ((step + 1) * _GOLDEN) % 1.0 < share  # evenly spread faulty steps

    def lr_factor(self, step: int) -> float:
        """The benign LR schedule's factor at ``step``: the cosine decay (1 without one) times
        the LR change (1 before ``lr_change_step``)."""
        changed = self.lr_change_step is not None and step >= self.lr_change_step
        factor = self.lr_change_mult if changed else 1.0
        if self.lr_cosine_floor is not None and step >= self.warmup_steps:
            span = max(1, self.steps - 1 - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            factor *= self.lr_cosine_floor + (1.0 - self.lr_cosine_floor) * cosine
        return factor

    @classmethod
    def preset(
        cls,
        name: str,
        *,
        seed: int = 0,
        steps: int | None = None,
        scale: Literal["default", "tiny"] = "default",
        **overrides: Any,
    ) -> ScenarioConfig:
        """The documented configuration of scenario ``name`` (keyword overrides win)."""
        if name not in PRESETS:
            raise ValueError(f"unknown scenario {name!r}; choose one of {SCENARIOS}")
        if scale not in SCALES:
            raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
        fields: dict[str, Any] = dict(PRESETS[name])
        fields.update(SCALES[scale])
        if scale == "tiny" and name in FA_SCENARIOS:
            fields["fa_bits"] = TINY_FA_BITS
        fields.update(seed=seed, **overrides)
        if steps is not None:
            fields["steps"] = steps
        return cls(scenario=name, **fields)


_GOLDEN = 0.6180339887498949  # (sqrt(5) - 1) / 2: the faulty steps of a ramp, evenly spread

# Fault knobs of each preset; everything else is the ScenarioConfig default.
_FA_KNOBS: dict[str, Any] = {"fa_sites": ("dS",), "fa_bits": 6, "fa_mode": "floor"}
_ROUTER_KNOBS: dict[str, Any] = {"router_lr_mult": 30.0, "fault_balance_coef": 0.0}
# The shortened scale: every knob not listed keeps its default. The FA fault keeps 3 bits (not
# 6) so that its effect shows within 300 steps of the fault.
TINY_FA_BITS = 3
SCALES: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": {
        "model": TestbedConfig(
            vocab=64,
            d_model=32,
            n_layers=2,
            n_heads=2,
            n_kv_heads=2,
            n_experts=4,
            top_k=2,
            d_expert=64,
            seq_len=32,
        ),
        "steps": 400,
        "batch_size": 8,
        "warmup_steps": 20,
        "monitor_every": 10,
        "markov_pool": 8,
        "markov_branching": 3,
        "fault_start": 150,
    },
}
PRESETS: dict[str, dict[str, Any]] = {
    "clean": {},
    "fa_precision": dict(_FA_KNOBS),
    "control": {**_FA_KNOBS, "fa_mode": "rne"},
    "router_instability": dict(_ROUTER_KNOBS),
    "combined": {**_FA_KNOBS, **_ROUTER_KNOBS},
}
