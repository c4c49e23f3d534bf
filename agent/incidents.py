"""Incidents: firing alerts grouped and attributed to a fault family, and the events that
notifiers deliver about them. Plain data, JSON-serializable through ``to_dict``."""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

FaultFamily = Literal["fa_precision", "router_instability", "combined", "unattributed"]
FAULT_FAMILIES: tuple[str, ...] = ("fa_precision", "router_instability", "combined", "unattributed")
# Families a rule can be evidence for ("symptom" is loss / grad-norm / NaN / hung-run evidence).
EVIDENCE_FAMILIES: tuple[str, ...] = ("fa_precision", "router_instability", "symptom")
Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")

# Kinds of incident events, each delivered exactly once per (incident id, kind, seq).
EventKind = Literal["opened", "updated", "escalated", "action", "repeat", "resolved"]


@dataclass
class Evidence:
    """One firing alert that supports an incident."""

    rule: str
    metric: str
    labels: dict[str, str]
    family: str  # one of EVIDENCE_FAMILIES
    severity: str
    value: float  # the reduced metric value at the latest evaluation
    baseline: float | None  # the detector's learned baseline, if it has one
    onset_step: int | None  # detector's estimate of where the departure began
    fired_step: int  # step at which the alert entered "firing"
    trend: str | None = None  # "falling", "rising" or None
    # the rule's detector fires on jumps only (a z-score spike): on the loss, an abrupt change
    # of the whole run (agent/attribution.py)
    abrupt: bool = False
    summary: str = ""
    suggest: str = ""
    # True when this evidence began after the incident had already damaged the loss: a
    # consequence of the fault, not a second cause (agent/attribution.py)
    consequence: bool = False
    consequence_of: str = ""  # what explains it, in words, when it is a consequence

    @property
    def key(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """The alert's identity across rounds: its rule and its labels."""
        return self.rule, tuple(sorted(self.labels.items()))


@dataclass
class ActionRecord:
    """What an action did (or would do, in dry-run) for an incident."""

    action: str
    step: int
    dry_run: bool
    ok: bool
    detail: str = ""
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


@dataclass
class Incident:
    id: str
    family: str  # one of FAULT_FAMILIES
    severity: str
    confidence: float  # 0..1
    opened_step: int
    onset_step: int | None
    status: Literal["open", "resolved"] = "open"
    evidence: list[Evidence] = field(default_factory=list)
    quiet_families: list[str] = field(default_factory=list)  # families that stayed quiet
    actions: list[ActionRecord] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    resolved_step: int | None = None
    updated_step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Incident:
        d = dict(d)
        d["evidence"] = [Evidence(**e) for e in d.get("evidence", [])]
        d["actions"] = [ActionRecord(**a) for a in d.get("actions", [])]
        return Incident(**d)


@dataclass
class RunContext:
    """Where a page comes from."""

    run_name: str = "run"
    host: str = field(default_factory=socket.gethostname)
    rank: int = field(default_factory=lambda: int(os.environ.get("RANK", "0") or 0))
    world_size: int = 1  # ranks in the job
    ranks: str = ""  # a distributed job's page: the ranks involved (agent.distributed.exchange)
    job_id: str | None = field(
        default_factory=lambda: (
            os.environ.get("SLURM_JOB_ID")
            or os.environ.get("MECHWATCH_JOB_ID")
            or os.environ.get("TORCHELASTIC_RUN_ID")
        )
    )


@dataclass
class IncidentEvent:
    """Something a person should hear about an incident. ``event_id`` deduplicates delivery."""

    kind: str  # one of EventKind
    seq: int  # per-incident sequence number of this event
    step: int
    incident: Incident
    context: RunContext = field(default_factory=RunContext)
    message: str = ""  # extra text for updates / actions / resolution

    @property
    def event_id(self) -> str:
        return f"{self.incident.id}:{self.kind}:{self.seq}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "seq": self.seq,
            "step": self.step,
            "incident": self.incident.to_dict(),
            "context": dataclasses.asdict(self.context),
            "message": self.message,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> IncidentEvent:
        return IncidentEvent(
            kind=d["kind"],
            seq=int(d["seq"]),
            step=int(d["step"]),
            incident=Incident.from_dict(d["incident"]),
            context=RunContext(**d["context"]),
            message=d.get("message", ""),
        )
