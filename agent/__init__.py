"""mechwatch: an in-process agent that watches training mechanisms, not symptoms.

``from agent import Agent`` is the entry point (imported lazily, so that torch-free parts such
as ``agent.detectors`` stay torch-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.lazy_exports import lazy_exports

__version__ = "0.1.0"
__all__, __getattr__ = lazy_exports(__name__, {"Agent": ".agent", "AgentConfig": ".config"})

if TYPE_CHECKING:
    from agent.agent import Agent as Agent
    from agent.config import AgentConfig as AgentConfig
