"""Where the read-only shared data lives (models, tokenizer, eval and calibration data)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ssmq.errors import SSMQError


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


def read_json(path: Path, missing: str) -> dict:
    """The JSON object in ``path``; one-line SSMQError ``missing`` when absent, or naming the parse error."""
    if not path.is_file():
        raise SSMQError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SSMQError(f"corrupt {path}: {e}") from None


DEFAULT_HUB_MODEL = "state-spaces/mamba2-130m"


def default_model() -> str:
    """$SSMQ_MODEL, else ../shared/models/mamba2 when present, else the hub id of Mamba2-130m."""
    env = os.environ.get("SSMQ_MODEL")
    if env:
        return env
    local = shared_path("models", "mamba2")
    return str(local) if local is not None else DEFAULT_HUB_MODEL
