"""Where stageserve keeps what it derives once per machine and reuses (never what it downloads: it downloads nothing)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/stageserve/NAME`` (``XDG_CACHE_HOME`` defaults to ``~/.cache``); not created here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stageserve" / name
