"""``page``: ask the agent to page people about the incident.

The page itself is delivered by the agent's notifiers (Slack, console, event log), which
deduplicate and never block training; this action only validates what a rule may say about the
page and reports the request, so that "page" can sit in a rule's ``actions`` list like any other
action and shows up in the audit trail.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams


class PageParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    severity: Literal["info", "warning", "critical"] | None = Field(
        None, description="override the incident's severity for this page; null: keep it"
    )
    message: str = Field("", max_length=2000, description="extra text for the page")


class PageAction(Action):
    """Request a page; the agent sends it through its notifiers."""

    name = "page"
    Params = PageParams
    # The incident's events are paged anyway: a page request runs once per firing episode,
    # unpaced, and is recorded in the audit log, not posted again in the incident's thread.
    pacing: ClassVar[Mapping[str, Any]] = {"cooldown": 0, "max_per_window": 1_000_000}
    repeats: ClassVar[bool] = False
    announce: ClassVar[bool] = False

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        assert isinstance(params, PageParams)
        severity = params.severity or (ctx.incident.severity if ctx.incident else None)
        incident = ctx.incident.id if ctx.incident else None
        detail = "page requested" + (f" ({severity})" if severity else "")
        after = {"page": True, "severity": severity, "message": params.message}
        return ActionOutcome(detail, {"incident": incident}, after)
