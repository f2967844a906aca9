"""One logging format for every process of a run (server, client, launcher)."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once; AJET_LOG_LEVEL (default INFO) sets the level."""
    root = logging.getLogger()
    if getattr(root, "_ajet_configured", False):
        return
    logging.basicConfig(
        level=(level or os.environ.get("AJET_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
    logging.getLogger("submitit").propagate = False  # submitit prints through its own handler
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    root._ajet_configured = True  # type: ignore[attr-defined]
