"""An agent configuration for tests of the symptom path alone (loss, grad norm, the optimizer's
steps): no QK, router or kernel-audit monitors, no console pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.config import AgentConfig


def symptoms_only(run_dir: Path, every: int, **notify: Any) -> AgentConfig:
    """Symptoms read every ``every`` steps; ``notify``: more ``notify`` settings."""
    return AgentConfig.model_validate(
        {
            "run_dir": run_dir,
            "symptoms": {"every": every},
            "qk": {"enabled": False},
            "router": {"enabled": False},
            "kernel_audit": {"enabled": False},
            "notify": {"console": "never", **notify},
        }
    )
