"""The watchdog of a distributed job: a rank that stops stepping is noticed and named.

Every rank's monitor thread publishes a heartbeat into the job's c10d store (the key-value
store torch.distributed rendezvoused with: no collective, nothing on the training thread)
every ``watchdog.check_every_s``: its last step and the seconds since it. Rank 0 reads every
rank's heartbeat and feeds one sample per rank, ``seconds_since_step{rank=r}``, the seconds
rank r has kept the job waiting:

- a rank behind the others (its last step older than the newest step any rank reached): the
  seconds since its last step as it reported them, plus the age of that report on rank 0's
  clock (a rank whose process froze stops reporting and keeps growing);
- a rank at the newest step while another is behind: 0 (it is only waiting for that one);
- all ranks at the same step: each rank's own seconds since its step (the whole job hangs).

The rules on ``seconds_since_step`` (``hung_run`` in symptoms.yaml) are evaluated on rank 0 in
a decision state of their own (series, alerts, incidents: pages only, never actions): the
watchdog's timing differs between ranks and must never reach the decision state that is
identical on every rank. The page names the rank (the alert's ``rank`` label).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Callable
from typing import Any

from agent import samples as m
from agent.attribution import Attributor
from agent.decisions import Decisions, decide
from agent.distributed.world import World
from agent.incidents import IncidentEvent, RunContext
from agent.rules.engine import RuleEngine
from agent.rules.ruleset import RuleSet
from agent.samples import Sample
from agent.store import SeriesStore
from remediations.pacing import Pacing


class _WatchdogAttributor(Attributor):
    """Incident ids of their own (``<run>-hung<n>-s<step>``): never one of the main state's."""

    def _open(self, step: int, firing: list) -> IncidentEvent:
        event = super()._open(step, firing)
        assert self.open is not None
        self.open.id = event.incident.id = f"{self.context.run_name}-hung{self._count}-s{step}"
        return event


def job_store(prefix: str) -> Any | None:
    """The job's c10d store under ``prefix`` (None, with a warning, when there is none)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return dist.PrefixStore(prefix, _get_default_store())
    except Exception as exc:  # another torch: the watchdog cannot see the other ranks
        warnings.warn(
            f"mechwatch: no c10d store ({exc!r}): the watchdog sees only its own rank",
            stacklevel=2,
        )
        return None


class RankWatch:
    """Heartbeats (every rank) and the hung-rank rules (rank 0); see the module docstring.

    ``on_round(step, decisions)`` receives each of rank 0's watchdog rounds (the agent logs the
    alert transitions and pages the incident events)."""

    def __init__(
        self,
        world: World,
        ruleset: RuleSet,
        context: RunContext,
        pacing: Pacing,
        on_round: Callable[[int, Decisions], None],
        store: Any | None = None,
    ) -> None:
        self.world = world
        self.store = store if store is not None else job_store(f"mechwatch/{context.run_name}/")
        self.on_round = on_round
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, rank 0's time of it)
        rules = tuple(r for r in ruleset if r.metric == m.SECONDS_SINCE_STEP)
        self.engine = RuleEngine(dataclasses.replace(ruleset, rules=rules), SeriesStore())
        self.attributor = _WatchdogAttributor(context, monitored_families=set())
        self.pacing = pacing

    def tick(self, step: int | None, idle_s: float) -> None:
        """Monitor thread, every ``check_every_s``: publish this rank's heartbeat; on rank 0
        also read everyone's and evaluate the watchdog rules."""
        if self.store is None:
            return
        self._beat += 1
        beat = {"step": step, "idle": idle_s, "beat": self._beat}
        self.store.set(f"beat/{self.world.rank}", json.dumps(beat))
        if self.world.rank != 0 or step is None:
            return
        samples = self.samples(step, self.read())
        if samples:
            self.on_round(
                step,
                decide(
                    self.engine, self.attributor, self.pacing, step, samples, time.time(), act=False
                ),
            )

    def read(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest heartbeat (ranks that have not reported yet are left out)."""
        out = {}
        for rank in range(self.world.size):
            key = f"beat/{rank}"
            if self.store.check([key]):
                out[rank] = json.loads(self.store.get(key))
        return out

    def samples(self, step: int, beats: dict[int, dict[str, Any]]) -> list[Sample]:
        """One ``seconds_since_step{rank}`` sample per reporting rank (module docstring)."""
        now = time.monotonic()
        for rank, beat in beats.items():
            if self._seen.get(rank, (None,))[0] != beat["beat"]:
                self._seen[rank] = (beat["beat"], now)
        steps = {r: -1 if b["step"] is None else b["step"] for r, b in beats.items()}
        newest = max(steps.values(), default=-1)
        behind = {r for r, s in steps.items() if s < newest}
        out = []
        for rank, beat in sorted(beats.items()):
            waited = beat["idle"] + (now - self._seen[rank][1])
            value = 0.0 if behind and rank not in behind else waited
            out.append(Sample.make(step, m.SECONDS_SINCE_STEP, value, rank=rank))
        return out
