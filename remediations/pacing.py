"""Pacing: when an action a rule asks for runs, when it runs again, and what happens when it
may not. The one policy of the actions layer (STYLE.md: an alert holds its lifecycle; cooldowns,
caps, standing requests, the rollback loop guard, escalation and the repeat page live here).

Clock. Pacing counts training steps actually run: a rollback moves the run's step back, never
this clock (``moved_to``), so steps that were run and then abandoned still count.

Episodes. While a rule fires for an incident, each of its actions has an *episode*: it starts
when the rule starts firing and ends when the rule stops firing (or the incident closes). In
an episode the action runs as soon as its limits allow, then, if it ``repeats`` (every action
but ``page`` and ``halt``), again each time its cooldown is over while the rule still fires:
a fix that did not hold is applied again. A dry run or a failed run ends the episode (a
failing action is not retried every evaluation).

Limits, per action name (real runs and dry runs counted apart), on the clock:

- ``cooldown``: steps after a run before the action may run again. A request that waits for
  it is reported once (``wait``) and runs when the cooldown is over, if its rule still fires.
  Within one round, an action admitted to run for one rule counts as run for the next rule
  that asks for it (two rules firing together cut the LR once, roll back once).
- ``max_per_window`` runs within the last ``window_steps`` steps: beyond it the request is
  dropped (``skip``), or, with ``on_limit: escalate``, the run is paged and halted
  (``escalate``). The rollback loop guard is this cap on ``rollback`` (2 per 5000 steps,
  escalate): a fault that returns after every rollback ends in a page and a halt, not a loop.

Where limits come from, first match wins: the keys next to an action's parameters in a rule
(``{lower_lr: {factor: 0.5, cooldown: 1000}}``), the rule's own ``cooldown`` (for each of its
actions that repeats: the rule says how often its fix may run again; ``page`` and ``halt`` run
once per episode and keep their own), the action class's ``pacing`` defaults,
``PacingLimits``' defaults.

Escalation on failure: an action whose error says the run must not go on as it is (an
exception with ``escalate = True``: no usable checkpoint, a restore that could not be undone)
escalates like a cap with ``on_limit: escalate``. Escalating runs ``ESCALATION_ACTION``.

Repeat page: an open incident is paged again ``repeat_every_steps`` steps (on the clock) or
``repeat_every_s`` seconds after its last page, whichever comes first.

Everything is decided from the arguments (steps, firing rules, ``now``): every rank reaches
the same decisions, and ``Agent.state_dict`` carries this state across restarts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ESCALATION_ACTION = "halt"  # what an escalation runs (it also pages: every action is announced)
_MAX_HISTORY = 256  # runs remembered per (action, dry run)


class PacingLimits(BaseModel):
    """The pacing keys a rule may write next to an action's parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dry_run: bool = Field(False, description="record what would be done; change nothing")
    cooldown: int = Field(
        500, ge=0, description="training steps after a run before the action may run again"
    )
    max_per_window: int = Field(3, ge=1, description="runs allowed within window_steps")
    window_steps: int = Field(10_000, ge=1, description="the window of max_per_window, in steps")
    on_limit: Literal["skip", "escalate"] = Field(
        "skip", description="beyond max_per_window: drop the request, or page and halt"
    )


PACING_KEYS: tuple[str, ...] = tuple(PacingLimits.model_fields)


def split_pacing(raw: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the action's own parameters, the pacing keys) of one action's mapping in a rule.
    Pacing keys are validated (pydantic ``ValidationError`` names the field)."""
    own = dict(raw or {})
    pacing = {k: own.pop(k) for k in PACING_KEYS if k in own}
    PacingLimits.model_validate(pacing)
    return own, pacing


@dataclass(frozen=True)
class ActionRequest:
    """An action a firing rule asks for, for an incident (what one episode runs)."""

    incident_id: str | None
    rule: str
    action: str
    params: dict[str, Any]  # as written in the rule, pacing keys included


@dataclass
class Admission:
    """What pacing says about one request this round."""

    request: ActionRequest
    verdict: Literal["run", "wait", "skip", "escalate"]
    reason: str = ""
    retry_in: int | None = None  # "wait": steps until the cooldown is over
    dry_run: bool = False


@dataclass
class _Episode:
    request: ActionRequest
    dry_run: bool
    ran: bool = False  # ran at least once in this episode
    done: bool = False  # nothing more in this episode
    told_waiting: bool = False  # a "wait" was reported for the current cooldown


@dataclass
class _Marks:
    """When an incident was last paged: clock steps and unix seconds."""

    clock: int
    time: float


LimitsOf = Callable[[ActionRequest], tuple[PacingLimits, bool]]  # (limits, repeats)


class Pacing:
    """The pacing state of one run (see the module docstring).

    Args:
        limits_of: the limits of a request and whether its action repeats (the runner knows
            the action classes; ``ActionRunner.limits_of``).
        rule_cooldowns: rule name -> the rule's ``cooldown`` (None: not set).
        dry_run_of: whether a request runs dry (the agent's ``actions.dry_run`` and
            ``actions.allow``), besides its own ``dry_run`` key.
        repeat_every_steps, repeat_every_s: the repeat page (None: never).
    """

    def __init__(
        self,
        limits_of: LimitsOf,
        *,
        rule_cooldowns: Mapping[str, int | None] | None = None,
        dry_run_of: Callable[[str], bool] | None = None,
        repeat_every_steps: int | None = 2000,
        repeat_every_s: float | None = None,
    ) -> None:
        self._limits_of = limits_of
        self.rule_cooldowns = dict(rule_cooldowns or {})
        self._dry_run_of = dry_run_of or (lambda action: False)
        self.repeat_every_steps = repeat_every_steps
        self.repeat_every_s = repeat_every_s
        self.clock: int | None = None  # training steps run, never rewound
        self.step: int | None = None  # the run's step when the clock was last advanced
        self._history: dict[tuple[str, bool], list[int]] = {}  # runs on the clock
        self._episodes: dict[tuple[str, str], _Episode] = {}  # (rule, action) -> episode
        self._paged: dict[str, _Marks] = {}  # incident id -> last page

    # -- the clock -----------------------------------------------------------------------------
    def advance(self, step: int) -> int:
        """Count the training steps run since the last call; returns the clock."""
        if self.clock is None or self.step is None:
            self.clock = 0
        else:
            self.clock += max(0, step - self.step)
        self.step = step
        return self.clock

    def moved_to(self, step: int) -> None:
        """The run continues from ``step`` (a rollback): the clock does not rewind."""
        self.step = step

    # -- actions -------------------------------------------------------------------------------
    def limits(self, request: ActionRequest) -> tuple[PacingLimits, bool]:
        """The limits a request runs under (rule cooldown applied) and whether it repeats."""
        limits, repeats = self._limits_of(request)
        rule_cooldown = self.rule_cooldowns.get(request.rule)
        if repeats and rule_cooldown is not None and "cooldown" not in request.params:
            limits = limits.model_copy(update={"cooldown": rule_cooldown})
        return limits, repeats

    def round(
        self,
        step: int,
        firing: Iterable[tuple[str, Sequence[tuple[str, Mapping[str, Any]]]]],
        incident_id: str | None,
    ) -> list[Admission]:
        """One decision round: ``firing`` is (rule, [(action, params), ...]) for every firing
        rule. Starts and ends episodes; returns what to do now, in the order asked."""
        now = self.advance(step)
        asked: dict[tuple[str, str], ActionRequest] = {}
        for rule, actions in firing:
            for name, params in actions:
                asked.setdefault((rule, name), ActionRequest(incident_id, rule, name, dict(params)))
        for key in [k for k, e in self._episodes.items() if k not in asked]:
            del self._episodes[key]  # the rule stopped firing: the episode is over
        out: list[Admission] = []
        admitted: set[tuple[str, bool]] = set()  # (action, dry run) admitted to run this round
        for key, request in asked.items():
            episode = self._episodes.get(key)
            if episode is None or episode.request.incident_id != incident_id:
                dry = self._dry_run_of(request.action) or self.limits(request)[0].dry_run
                episode = self._episodes[key] = _Episode(request, dry)
            if not episode.done:
                admission = self._admit(episode, now, admitted)
                if admission is not None:
                    out.append(admission)
                    if admission.verdict == "run":
                        admitted.add((request.action, episode.dry_run))
        return out

    def _admit(
        self, episode: _Episode, now: int, admitted: set[tuple[str, bool]]
    ) -> Admission | None:
        """The verdict on an episode's request now. An action another rule was admitted to run
        in this round counts as run now (two rules firing together run a fix once: the later
        one waits for its cooldown like after any run)."""
        request, dry = episode.request, episode.dry_run
        limits, _ = self.limits(request)
        runs = self._history.get((request.action, dry), [])
        if (request.action, dry) in admitted:
            runs = [*runs, now]
        if runs and now - runs[-1] < limits.cooldown:
            if episode.told_waiting:
                return None
            episode.told_waiting = True
            left = limits.cooldown - (now - runs[-1])
            reason = f"cooldown ({left} more steps; cooldown {limits.cooldown})"
            return Admission(request, "wait", reason, left, dry)
        recent = sum(1 for t in runs if t > now - limits.window_steps)
        if recent >= limits.max_per_window:
            episode.done = True
            reason = (
                f"{recent} runs of {request.action} in the last {limits.window_steps} training "
                f"steps (max_per_window {limits.max_per_window})"
            )
            return Admission(request, limits.on_limit, reason, None, dry)
        return Admission(request, "run", "", None, dry)

    def ran(self, admission: Admission, *, ok: bool) -> None:
        """The runner ran an admitted request (``ok``: applied or dry run without error).
        Records the run (failures count too) and decides whether the episode goes on."""
        request, dry = admission.request, admission.dry_run
        runs = self._history.setdefault((request.action, dry), [])
        runs.append(self.clock if self.clock is not None else 0)
        del runs[:-_MAX_HISTORY]
        episode = self._episodes.get((request.rule, request.action))
        if episode is None:
            return
        limits, repeats = self.limits(request)
        episode.ran, episode.told_waiting = True, True  # waits for the next cooldown silently
        episode.done = not (ok and repeats and not dry and limits.cooldown > 0)

    def standing(self) -> list[ActionRequest]:
        """Requests whose episode goes on (they run again when their cooldown allows)."""
        return [e.request for e in self._episodes.values() if not e.done]

    # -- pages ---------------------------------------------------------------------------------
    def paged(self, incident_id: str, now: float) -> None:
        """An incident was paged (opened, updated, escalated, repeated)."""
        self._paged[incident_id] = _Marks(self.clock or 0, now)

    def repeat_due(self, incident_id: str, now: float) -> bool:
        """Whether an open incident is due a repeat page."""
        last = self._paged.get(incident_id)
        if last is None:
            return False
        steps = self.repeat_every_steps
        if steps is not None and (self.clock or 0) - last.clock >= steps:
            return True
        return self.repeat_every_s is not None and now - last.time >= self.repeat_every_s

    def closed(self, incident_id: str) -> None:
        """An incident resolved: forget its marks and its episodes."""
        self._paged.pop(incident_id, None)
        for key in [k for k, e in self._episodes.items() if e.request.incident_id == incident_id]:
            del self._episodes[key]

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "step": self.step,
            "history": [[n, d, list(t)] for (n, d), t in sorted(self._history.items())],
            "episodes": [
                {**asdict(e), "request": asdict(e.request)} for e in self._episodes.values()
            ],
            "paged": {k: [m.clock, m.time] for k, m in self._paged.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.clock = state.get("clock")
        self.step = state.get("step")
        self._history = {
            (str(n), bool(d)): [int(t) for t in times] for n, d, times in state.get("history", [])
        }
        self._episodes = {}
        for e in state.get("episodes", []):
            request = ActionRequest(**e["request"])
            fields = {k: bool(e[k]) for k in ("dry_run", "ran", "done", "told_waiting")}
            self._episodes[(request.rule, request.action)] = _Episode(request, **fields)
        self._paged = {k: _Marks(int(c), float(t)) for k, (c, t) in state.get("paged", {}).items()}
