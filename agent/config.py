"""The agent's configuration (``mechwatch.yaml``): every field has a default, so
``Agent(model, optimizer)`` works with none. Unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.checkpoints import DEFAULT_EVERY, DEFAULT_KEEP_KNOWN_GOOD, DEFAULT_KEEP_LAST
from agent.discovery import DiscoveryOverrides
from agent.notify.config import NotifyConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QKMonitorConfig(_Strict):
    enabled: bool = Field(True, description="measure the attention Q/K increment spectra")
    delta: int = Field(
        25,
        ge=1,
        description="steps between two snapshots of W_q/W_k; the increment spans delta steps "
        "(25 on the test bed: one evaluation per 25 steps, see README 'Why delta = 25')",
    )
    orders: list[int] = Field(
        [2, 3], description="which increments to measure: 1 (Delta_1), 2 (Delta_2), 3 (Delta_3)"
    )
    layers_per_eval: int | None = Field(
        None, ge=1, description="attention layers measured per evaluation (rotating); None: all"
    )
    heads_per_layer: int | None = Field(
        None,
        ge=1,
        description="query heads measured per layer and evaluation (rotating); None: all",
    )
    controls: int = Field(
        4,
        ge=0,
        description="control matrices per attention layer (values, output projection, MLP: "
        "agent/discovery/controls.py), measured like Q/K for the differential diagnosis; 0: none",
    )
    control_rows: int | None = Field(
        512,
        ge=1,
        description="a control matrix with both dimensions above this is measured on its "
        "first control_rows rows (output units): an SVD of O(max dim x control_rows^2) instead "
        "of a full one, which at 4096 x 4096 and up costs more than every QK head of the layer "
        "(benchmarks/results/scale.md); None: whole matrices",
    )
    snapshot_device: str | None = Field(
        None, description="where snapshots live: None (next to the weights) or 'cpu'"
    )
    worker: Literal["auto", "process", "thread"] = Field(
        "auto",
        description="where QK jobs run: 'process' (a worker process on shared-memory "
        "snapshots, agent/monitor_process.py: its Python never holds the training process's "
        "interpreter lock), 'thread' (the agent's monitor thread), 'auto' (the process when "
        "the snapshots are on the CPU in a one-process run, else the thread)",
    )
    budget: float | None = Field(
        None,
        gt=0,
        le=1,
        description="adaptive sampling: keep the monitor thread's QK work within this fraction "
        "of the measured step time (0.01: 1%) by measuring fewer layers (then heads) per "
        "evaluation (agent/monitor_budget.py); None: the fixed layers_per_eval / heads_per_layer. "
        "One process only",
    )


class RouterMonitorConfig(_Strict):
    enabled: bool = Field(True, description="hook the MoE routers")
    every: int = Field(25, ge=1, description="steps between two read-outs of the router statistics")
    default_top_k: int = Field(1, ge=1, description="top-k for load statistics when undeclared")


MAX_AUDIT_EVERY = 50  # steps: the derived cadence of a model with few layers


class KernelAuditConfig(_Strict):
    enabled: bool = Field(
        True,
        description="audit the attention backward's rounding (remediations/kernel_audit.py): "
        "needs the layers to run through the FP32-backward switch's wrappers",
    )
    every: int | None = Field(
        None,
        ge=1,
        description="steps between two audits; each audits the next layer in turn (None: "
        "sweep_steps / the layers, at most 50)",
    )
    sweep_steps: int = Field(
        100,
        ge=1,
        description="every layer is audited at least once in this many steps when `every` is "
        "not set (a fault in one layer is found within it: keep the audit rule's rollback "
        "margin_steps at least this)",
    )
    sequences: int = Field(1, ge=1, description="batch rows of the audited call kept and replayed")

    def steps_between(self, layers: int) -> int:
        """Steps between two audits for a model of ``layers`` attention layers."""
        if self.every is not None:
            return self.every
        return min(MAX_AUDIT_EVERY, max(1, self.sweep_steps // max(layers, 1)))


class SymptomConfig(_Strict):
    every: int = Field(
        10, ge=1, description="steps between two read-outs of the buffered loss / grad norm"
    )
    grad_norm: bool = Field(
        True, description="compute the gradient norm when step() is not given one"
    )


class WatchdogConfig(_Strict):
    enabled: bool = Field(
        True,
        description="evaluate the rules on `seconds_since_step` (the hung_run rule of "
        "symptoms.yaml sets the timeout) on a timer, off the training thread",
    )
    check_every_s: float = Field(30.0, gt=0, description="how often the watchdog looks, seconds")


class SchedulingConfig(_Strict):
    apply_lag: int = Field(
        5,
        ge=0,
        description="monitor results measured at step t are applied to the rules at step "
        "t + apply_lag on every rank alike (the training thread waits for a late result)",
    )
    max_wait_s: float = Field(
        120.0, gt=0, description="longest wait for a late monitor result before dropping it"
    )


class ActionsConfig(_Strict):
    enabled: bool = Field(True, description="run the actions the rules name")
    dry_run: bool = Field(False, description="record and page what would be done; change nothing")
    allow: list[str] | None = Field(
        None, description="action names allowed to run (None: all); others are paged as proposed"
    )


class CheckpointConfig(_Strict):
    enabled: bool = Field(False, description="save checkpoints for rollback")
    directory: Path | None = Field(None, description="default: <run_dir>/checkpoints")
    every: int = Field(DEFAULT_EVERY, ge=1, description="steps between checkpoints")
    keep_last: int = Field(
        DEFAULT_KEEP_LAST, ge=1, description="how many recent checkpoints to keep"
    )
    keep_known_good: int = Field(
        DEFAULT_KEEP_KNOWN_GOOD, ge=0, description="healthy checkpoints kept in addition"
    )


class MetricsConfig(_Strict):
    tensorboard: Path | None = Field(
        None,
        description="TensorBoard log dir for the agent's metrics (relative: under run_dir); "
        "needs the tensorboard package; None: off",
    )
    wandb: bool = Field(
        False, description="log the agent's metrics into the current wandb run (needs wandb)"
    )


class AgentConfig(_Strict):
    # Validation errors never echo inputs: a mistyped Slack key must not print the token.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    run_name: str = Field("run", description="names the run in pages and incident ids")
    run_dir: Path = Field(
        Path("mechwatch_runs/run"), description="event log, page outbox and checkpoints"
    )
    rules: list[Path] | None = Field(
        None, description="rule files; None: the packs shipped in rules/"
    )
    qk: QKMonitorConfig = Field(default_factory=QKMonitorConfig)
    router: RouterMonitorConfig = Field(default_factory=RouterMonitorConfig)
    kernel_audit: KernelAuditConfig = Field(default_factory=KernelAuditConfig)
    symptoms: SymptomConfig = Field(default_factory=SymptomConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    actions: ActionsConfig = Field(default_factory=ActionsConfig)
    checkpoints: CheckpointConfig = Field(default_factory=CheckpointConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    discovery: DiscoveryOverrides = Field(default_factory=DiscoveryOverrides)
    metrics: MetricsConfig = Field(
        default_factory=MetricsConfig,
        description="where the agent's metrics go besides the event log (agent/metric_sinks.py)",
    )
    metrics_every: int = Field(
        1, ge=1, description="write every n-th monitor evaluation's samples to the event log"
    )
