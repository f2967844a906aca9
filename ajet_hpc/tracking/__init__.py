"""Context tracking: every model call as a timeline of token ids, token-in and token-out."""

from ajet_hpc.tracking.context import ContextTracker, PromptPlan
from ajet_hpc.tracking.timeline import (
    AUTHOR_NAMES,
    MODEL,
    SYSTEM,
    TOOL,
    USER,
    DriftEvent,
    Timeline,
)

__all__ = [
    "AUTHOR_NAMES",
    "MODEL",
    "SYSTEM",
    "TOOL",
    "USER",
    "ContextTracker",
    "DriftEvent",
    "PromptPlan",
    "Timeline",
]
