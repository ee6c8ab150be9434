"""The base install runs the core CLI: ``ssmq info``, ``generate``, ``quantize`` and ``eval`` (perplexity) never
import an optional package (Triton, the server's, the interop and GGUF readers, lm-eval) on their way, so a user
without an extra gets the product, or a one-line "install the extra" message, never an ImportError traceback.

Each command runs in a subprocess whose import system refuses those packages, as a machine without them would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import shared_or_skip

OPTIONAL = ("triton", "fastapi", "uvicorn", "starlette", "compressed_tensors", "gguf", "lm_eval", "prometheus_client")

# Runs ``python -m ssmq.cli ARGS`` with OPTIONAL unimportable, as on a machine without them; lists at exit any
# optional module that got imported anyway.
_BLOCKED_RUN = """
import runpy, sys
blocked = sys.argv[1].split(",")
for name in blocked:  # None in sys.modules: import raises ModuleNotFoundError, find_spec answers None
    sys.modules[name] = None
sys.argv = ["ssmq", *sys.argv[2:]]
try:
    runpy.run_module("ssmq.cli", run_name="__main__")
finally:
    leaked = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] in blocked)
    if leaked:
        print("LEAKED", leaked, file=sys.stderr)
"""


def _run_blocked(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKED_RUN, ",".join(OPTIONAL), *args], capture_output=True,
                          text=True, timeout=600)


def _assert_clean(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "LEAKED" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_help_text_prints_without_optional_packages():
    for cmd in ([], ["info"], ["generate"], ["quantize"], ["eval"], ["export"], ["serve"], ["plan"]):
        _assert_clean(_run_blocked(*cmd, "--help"))


@pytest.mark.parametrize("command", ["info", "generate", "quantize", "eval"])
def test_core_commands_run_without_optional_packages(command, tmp_path):
    model = str(shared_or_skip("models", "mamba2"))
    args = {
        "info": ["info", "--model", model],
        "generate": ["generate", "--model", model, "--max-new-tokens", "4", "--prompt", "The"],
        "quantize": ["quantize", "--model", model, "--recipe", "rtn-w4a16-g128", "--out", str(tmp_path / "q")],
        "eval": ["eval", "--model", model, "--tasks", "wikitext2", "--limit", "1", "--seqlen", "64",
                 "--out", str(tmp_path / "e")],
    }[command]
    _assert_clean(_run_blocked(*args))


def test_an_optional_feature_without_its_package_is_one_line():
    """``ssmq serve`` without fastapi says which extra to install, in one line, exit 1."""
    r = _run_blocked("serve", "--model", "nonexistent-model-folder", "--port", "0")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
