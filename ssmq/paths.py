"""Where the read-only shared data lives (models, tokenizer, eval and calibration data)."""

from __future__ import annotations

import os
from pathlib import Path


def shared_dir() -> Path | None:
    """$SSMQ_SHARED, else the ``shared/`` folder beside the checkout (../shared), else None."""
    env = os.environ.get("SSMQ_SHARED")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parent.parent
    candidates += [repo.parent / "shared", repo / "shared", Path.cwd().parent / "shared"]
    for c in candidates:
        if (c / "models").is_dir() or (c / "data").is_dir():
            return c
    return None


def shared_path(*parts: str) -> Path | None:
    """A path under the shared folder, or None when the shared folder or that entry is absent."""
    root = shared_dir()
    if root is None:
        return None
    p = root.joinpath(*parts)
    return p if p.exists() else None
