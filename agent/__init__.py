"""mechwatch: an in-process agent that watches training mechanisms, not symptoms.

``from agent import Agent`` is the entry point (imported lazily, so that torch-free parts such
as ``agent.detectors`` stay torch-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Agent", "AgentConfig"]

if TYPE_CHECKING:
    from agent.agent import Agent
    from agent.config import AgentConfig


def __getattr__(name: str) -> Any:
    if name == "Agent":
        from agent.agent import Agent

        return Agent
    if name == "AgentConfig":
        from agent.config import AgentConfig

        return AgentConfig
    raise AttributeError(f"module 'agent' has no attribute {name!r}")
