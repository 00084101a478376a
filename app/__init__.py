"""inferproxy: a caching and checkpointing proxy for batch LLM inference."""

from __future__ import annotations

__version__ = "0.1.0"
