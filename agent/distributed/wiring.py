"""The parts of an ``Agent`` that differ between one process and a distributed job, chosen
once from its ``World`` (``agent.distributed.world``): the measurement pipeline, the
checkpoint store, the metric sinks and the hung-rank watchdog."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from agent.checkpoints import CheckpointManager, CheckpointStore
from agent.config import AgentConfig, MetricsConfig
from agent.costs import Costs
from agent.discovery import AttentionSite, RouterSite
from agent.distributed.world import World
from agent.measurements import Measurements, Report, Submit

if TYPE_CHECKING:
    from agent.agent import Agent
    from agent.distributed.watchdog import RankWatch


def build_measurements(
    world: World,
    model: torch.nn.Module,
    config: AgentConfig,
    attention_sites: list[AttentionSite],
    router_sites: list[RouterSite],
    *,
    submit: Submit,
    report: Report,
    costs: Costs,
) -> Measurements:
    """One process: ``Measurements``; several ranks: ``DistributedMeasurements``."""
    if not world.collective:
        return Measurements(
            model, config, attention_sites, router_sites, submit=submit, report=report, costs=costs
        )
    from agent.distributed.measurements import DistributedMeasurements

    return DistributedMeasurements(
        model,
        config,
        attention_sites,
        router_sites,
        world=world,
        submit=submit,
        report=report,
        costs=costs,
    )


def metrics_config(world: World, config: AgentConfig) -> MetricsConfig:
    """The metric sinks of this rank: the samples are the same on every rank, so only rank 0
    writes TensorBoard and W&B (an ``on_metrics`` callback runs on every rank)."""
    return config.metrics if world.rank == 0 else MetricsConfig()


def build_checkpoints(
    agent: Agent,
    data_state: Callable[[], Any] | None,
    restore_data: Callable[[Any, int], None] | None,
) -> CheckpointStore | None:
    """The configured checkpoint store (None: checkpoints disabled): ``CheckpointManager``
    in one process, ``DistributedCheckpointStore`` (torch.distributed.checkpoint) across
    ranks."""
    cfg = agent.config.checkpoints
    if not cfg.enabled:
        return None
    common = dict(
        model=agent.model,
        optimizer=agent.optimizer,
        scheduler=agent.scheduler,
        every_n_steps=cfg.every,
        keep_last=cfg.keep_last,
        keep_known_good=cfg.keep_known_good,
        agent_state=agent.state_dict,
        data_state=data_state,
        restore_data=restore_data,
        report=lambda kind, message: _checkpoint_report(agent, kind, message),
    )
    directory = cfg.directory or agent.run_dir / "checkpoints"
    if not agent.world.collective:
        return CheckpointManager(directory, **common)
    from agent.distributed.checkpoints import DistributedCheckpointStore

    return DistributedCheckpointStore(directory, world=agent.world, **common)


def _checkpoint_report(agent: Agent, kind: str, message: str) -> None:
    """The checkpoint writer names a failed save's cause once (the store warned already),
    and its recovery: ``error`` and ``recovered`` records."""
    step = -1 if agent._last_step is None else agent._last_step
    record = "recovered" if kind.endswith("recovered") else "error"
    agent._write(record, step, what="checkpoint", error=message)


def build_rank_watch(agent: Agent) -> RankWatch | None:
    """The hung-rank watchdog of a distributed job (None in one process)."""
    if not agent.world.collective or not agent.config.watchdog.enabled:
        return None
    from agent.distributed.watchdog import RankWatch

    return RankWatch(
        agent.world,
        agent.ruleset,
        agent.context,
        agent.new_pacing(),
        lambda step, decisions: agent._guarded(
            "watchdog", lambda: agent._record(step, decisions), None
        ),
    )
