"""Fault matrix of the ssmq command: each case runs the CLI in a subprocess, with the fault injected where the
machine cannot make it for real (a kill -9 at a chosen point of the save, a read-only or full file system as the
OSError the kernel would raise), and asserts the exit status, exactly one stderr line, no traceback, and nothing
left behind beyond what is documented (a killed save's temporary folder, removed by the next run writing there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shared_or_skip

ROOT = Path(__file__).resolve().parent.parent

# injected faults: Python run before ssmq's main() in the subprocess
KILL_DURING_SAVE = """
import os, signal, safetensors.torch as st
_save = st.save_file
def save_file(tensors, path, metadata=None):
    _save(tensors, path, metadata=metadata)  # the weights are written, the manifest is not: then kill -9
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_file
"""
READ_ONLY = """
import errno, os, pathlib
_mkdir = pathlib.Path.mkdir
def mkdir(self, *a, **k):
    if str(self).startswith(os.environ["FAULT_DIR"]):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    return _mkdir(self, *a, **k)
pathlib.Path.mkdir = mkdir
"""
FULL_PREFLIGHT = """
import collections, shutil
shutil.disk_usage = lambda p: collections.namedtuple("usage", "total used free")(10**9, 10**9 - 4096, 4096)
"""
FULL_DURING_SAVE = """
import errno, os, safetensors.torch as st
def save_file(tensors, path, metadata=None):
    open(path, "wb").write(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
st.save_file = save_file
"""


def run(args, fault: str = "", env=None, stdin=None, cwd=None):
    code = fault + "\nimport sys\nfrom ssmq.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, env=full_env, input=stdin,
                          timeout=600, cwd=cwd)


def one_line(r, code: int = 1, *needles: str) -> str:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == code, err[-2000:]
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("ssmq: error: "), err[-2000:]
    for n in needles:
        assert n in err, err
    return err


def mamba2() -> str:
    return str(shared_or_skip("models", "mamba2"))


def quantize_args(out: Path, recipe: str = "rtn-w8a16") -> list[str]:
    return ["quantize", "--model", mamba2(), "--recipe", recipe, "--out", str(out), "--device", "cpu"]


def test_kill_during_save_leaves_a_recognisable_folder_that_the_next_run_removes(tmp_path):
    r = run(quantize_args(tmp_path / "q"), KILL_DURING_SAVE)
    assert r.returncode == -9
    (left,) = list(tmp_path.iterdir())  # nothing at the target; one temporary folder named for the killed writer
    assert left.name.startswith(".ssmq-tmp-") and left.name.endswith("-q") and not (tmp_path / "q").exists()
    os.symlink(mamba2(), tmp_path / "m")  # a model folder beside the leftover: info lists it
    info = run(["info", "--model", str(tmp_path / "m")])
    out = info.stdout.decode()
    assert info.returncode == 0 and f"temporary folder {left.name}" in out and "is gone" in out, out
    ok = run(quantize_args(tmp_path / "q2"))
    assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "q2"]  # the leftover is gone
    info = run(["info", "--model", str(tmp_path / "q2")])
    assert info.returncode == 0 and b"temporary folder" not in info.stdout
    assert b"rtn-w8a16" in info.stdout and b"bfloat16" in info.stdout


def test_read_only_output_is_refused_before_any_work(tmp_path):
    out = tmp_path / "ro" / "q"
    r = run(quantize_args(out), READ_ONLY, env={"FAULT_DIR": str(tmp_path / "ro")})
    one_line(r, 1, "read-only file system", str(tmp_path / "ro"))
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_refused_before_quantizing(tmp_path):
    r = run(quantize_args(tmp_path / "q"), FULL_PREFLIGHT)
    one_line(r, 1, "not enough free space", "4.1 kB free")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_during_save_is_one_line_and_leaves_nothing(tmp_path):
    r = run(quantize_args(tmp_path / "q"), FULL_DURING_SAVE)
    one_line(r, 1, "no space left on the device", "model.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "q"
    r = run(quantize_args(out))
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_and_malformed_checkpoints_are_one_line(tmp_path, checkpoint):
    bad = _copy(checkpoint, tmp_path / "flip")
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(data))
    one_line(run(["generate", "--model", str(bad)]), 1, "checksum mismatch")
    for field, value, needle in [("dtype", "nonsense", "'dtype' must be one of"),
                                 ("format_version", "1", "'format_version' must be int"),
                                 ("files", [], "'files' must be dict")]:
        bad = _copy(checkpoint, tmp_path / f"m-{field}")
        manifest = json.loads((bad / "quantization.json").read_text())
        manifest[field] = value
        (bad / "quantization.json").write_text(json.dumps(manifest))
        for cmd in ("generate", "info"):
            one_line(run([cmd, "--model", str(bad)]), 1, needle)
    bad = _copy(checkpoint, tmp_path / "tok")
    (bad / "tokenizer.json").write_text('{"truncated": ')
    manifest = json.loads((bad / "quantization.json").read_text())
    del manifest["files"]["tokenizer.json"]  # a tokenizer edited after the save: read, and refused in one line
    (bad / "quantization.json").write_text(json.dumps(manifest))
    one_line(run(["generate", "--model", str(bad)]), 1, "cannot read the tokenizer", "tokenizer.json")


def test_malformed_recipe_file_is_refused_naming_the_field(tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps({"name": "r", "linears": [{"modules": ["layers.*"], "exclude": ["*.dt_proj"],
                                                             "weight": {"dtype": "int8", "symmetric": "yes"}}]}))
    one_line(run(quantize_args(tmp_path / "q", str(recipe))), 1, "'symmetric' must be true or false")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("args,needle", [
    (["generate", "--seed", "-1"], "seed must be an integer in [0, 2**63)"),
    (["generate", "--device", "tpu:0"], "--device 'tpu:0' is not a device"),
    (["eval", "--device", "tpu", "--tasks", "wikitext2", "--limit", "1"], "--device 'tpu' is not a device"),
    (["generate", "--prompt-file", "/nonexistent/p.txt"], "--prompt-file /nonexistent/p.txt"),
    (["plan", "--model", "mamba2-130m", "--gpu-mem", "1KiB"], "does not hold the weights"),
])
def test_bad_arguments_are_one_line(args, needle):
    one_line(run(args), 1, needle)


def test_non_utf8_prompt_bytes_are_one_line(tmp_path):
    mamba2()
    r = subprocess.run([sys.executable, "-m", "ssmq.cli", "generate", "--prompt", b"caf\xe9 au lait"],
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    one_line(r, 1, "--prompt #1 is not UTF-8 text (byte 0xe9 at offset 3)")
    one_line(run(["generate", "--prompt-file", "-"], stdin=b"\xff\xfe"), 1, "the prompt on stdin is not UTF-8")


def test_plan_out_unwritable_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    r = run(["plan", "--model", "mamba2-130m", "--out", str(tmp_path / "file" / "sub")])
    one_line(r, 1, str(tmp_path / "file"))
    r = run(["plan", "--model", "mamba2-130m", "--out", str(tmp_path / "ro")], READ_ONLY,
            env={"FAULT_DIR": str(tmp_path / "ro")})
    one_line(r, 1, "read-only file system")


@pytest.mark.parametrize("args", [
    ["eval", "--tasks", "wikitext2", "--limit", "1", "--out", "{ro}/r.json"],
    ["export", "--model", "{ro}/none", "--format", "compressed-tensors", "--out", "{ro}/ct"],
])
def test_unwritable_outputs_of_other_commands_are_refused_before_any_work(tmp_path, args):
    ro = tmp_path / "ro"
    r = run([a.format(ro=ro) for a in args], READ_ONLY, env={"FAULT_DIR": str(ro)})
    one_line(r, 1, "read-only file system", str(ro))
    assert list(tmp_path.iterdir()) == []
