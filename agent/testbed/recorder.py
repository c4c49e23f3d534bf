"""The test bed's monitors: the agent's own measurement pipeline, run inline.

``MonitorRecorder`` measures a test-bed run exactly as the agent does (``agent.measurements``:
the same discovery, probes, monitors, metric names and definitions), every ``every`` steps:
QK spectra of the increment over the last ``every`` steps (``qk.delta = every``), and the
routers' statistics averaged over every forward since the last read-out (``router.every =
every``). The only difference from the agent is the executor: the spectra are computed inline
and returned at the step they measure (``apply_lag = 0``), so a record is complete when the
step is. The loss and grad norm are the runner's own, recorded every step.
"""

from __future__ import annotations

from agent.config import AgentConfig
from agent.discovery import find_attention, find_routers
from agent.measurements import Measurements, run_inline
from agent.samples import Sample
from agent.testbed.model import MoETransformer

SampleRow = list  # [step, metric, {label: value}, value], as in the event log's metrics records


class MonitorRecorder:
    """The agent's monitors on ``model`` every ``every`` steps; ``every = 0`` switches it off."""

    def __init__(self, model: MoETransformer, every: int) -> None:
        if every < 0:
            raise ValueError(f"MonitorRecorder: every must be >= 0, got {every}")
        self.every = every
        self.measurements: Measurements | None = None
        if every == 0:
            return
        config = AgentConfig.model_validate(
            {
                "qk": {"delta": every},
                "router": {"every": every},
                "symptoms": {"every": every, "grad_norm": False},
                "scheduling": {"apply_lag": 0},
            }
        )
        self.measurements = Measurements(
            model,
            config,
            find_attention(model, config.discovery),
            find_routers(model, config.discovery),
            submit=run_inline,
            report=_raise,
        )

    def after_step(self, step: int) -> list[SampleRow] | None:
        """The samples measured after optimizer step ``step`` (None when there are none)."""
        if self.measurements is None:
            return None
        samples = self.measurements.collect(step)
        return [_row(s) for s in samples] or None

    def reset(self) -> None:
        """Forget the snapshots (after a rollback the previous snapshot is no longer valid)."""
        if self.measurements is not None:
            self.measurements.restart()

    def close(self) -> None:
        if self.measurements is not None:
            self.measurements.close()


def _row(sample: Sample) -> SampleRow:
    return [sample.step, sample.metric, sample.label_dict, sample.value]


def _raise(what: str, text: str) -> None:
    """The test bed measures for science: a monitor that fails must fail the run."""
    raise RuntimeError(f"test-bed monitors: {what}: {text}")
