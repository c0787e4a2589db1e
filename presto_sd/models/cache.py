"""Where presto-sd keeps what it fetches (wheels, converted models, datasets).

Everything lives outside the repository, under ``$PRESTO_SD_CACHE`` (default
``~/.cache/presto-sd``), so nothing downloaded is ever committed.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """Return ``$PRESTO_SD_CACHE/<parts...>``, creating it."""
    root = Path(os.environ.get("PRESTO_SD_CACHE", Path.home() / ".cache" / "presto-sd"))
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
