"""mechwatch: an in-process agent that watches training mechanisms, not symptoms."""

from __future__ import annotations

__version__ = "0.1.0"
