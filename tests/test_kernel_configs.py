"""Kernel launch settings as data: ``ssmq/kernels/configs/<op>.json`` read once (the device's entry, else the default
one), shipped in the package, and written by ``ssmq bench kernels --tune OP`` (which refuses without a GPU)."""

from __future__ import annotations

import json
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from ssmq.bench import tune
from ssmq.kernels import configs

ROOT = Path(__file__).resolve().parent.parent
OPS = sorted(p.stem for p in configs.FOLDER.glob("*.json"))


def test_every_config_has_a_why_and_a_default_entry():
    assert {"qgemv", "state_update", "quant_gemm", "gemv"} <= set(OPS)
    for op in OPS:
        data = json.loads(configs.path(op).read_text())
        assert data["why"] and configs.DEFAULT in data["devices"], op
        assert configs.load(op) == data["devices"][configs.DEFAULT]  # no GPU here: the default entry
        assert configs.load(op) is configs.load(op)  # read once: every caller shares (and may override) one dict


def test_the_package_ships_the_configs():
    """pyproject's package-data takes every config file; the installed package (an editable one here) finds them
    through its own module path."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["ssmq.kernels.configs"]
    assert OPS and all(any(fnmatch(f"{op}.json", pat) for pat in patterns) for op in OPS)
    assert configs.FOLDER == Path(sys.modules["ssmq.kernels.configs"].__file__).parent


def test_a_written_entry_is_picked_for_its_device_only(tmp_path, monkeypatch):
    """The round trip of ``--tune``'s file: an entry written for one device name is what that device loads; any
    other device falls back to the default entry, and the rest of the file is kept."""
    shipped = json.loads(configs.path("qgemv").read_text())
    settings = {**shipped["devices"][configs.DEFAULT], "BN_FMA": 128, "ROUTE_ROWS": {"int4": 1, "int8": 2, "fp8": 1}}
    path = tune.save("qgemv", "NVIDIA Test GPU", settings, tmp_path / "qgemv.json")
    data = json.loads(path.read_text())
    assert data["why"] == shipped["why"] and data["devices"][configs.DEFAULT] == shipped["devices"][configs.DEFAULT]
    assert configs.entry(data, "NVIDIA Test GPU") == settings
    assert configs.entry(data, "NVIDIA Other GPU") == shipped["devices"][configs.DEFAULT]
    monkeypatch.setattr(configs, "FOLDER", tmp_path)
    monkeypatch.setattr(configs, "device_name", lambda: "NVIDIA Test GPU")
    configs.load.cache_clear()
    try:
        assert configs.load("qgemv") == settings
    finally:
        configs.load.cache_clear()


def test_candidates_are_set_in_place():
    cfg = {"tile": 1, "int8": {"tile": 2}}
    inner = cfg["int8"]
    tune._set(cfg, {"tile": 3, "int8/tile": 4})
    assert cfg == {"tile": 3, "int8": {"tile": 4}} and cfg["int8"] is inner and tune._get(cfg, "int8/tile") == 4


def test_tune_refuses_without_a_gpu(capsys):
    from ssmq.cli import main

    assert main(["bench", "kernels", "--tune", "qgemv", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ssmq: error: --tune times launch settings on a CUDA GPU; the device here is cpu"]


@pytest.mark.parametrize("op", sorted(tune.TUNABLE))
def test_the_settings_in_force_are_candidates(op):
    """Every grid path names a setting of the op, and its shipped value is among the candidates (a tune can keep
    it)."""
    settings = json.loads(configs.path(op).read_text())["devices"][configs.DEFAULT]
    assert all(tune._get(settings, p) in values for p, values in tune.TUNABLE[op].grid.items())
    assert tune.TUNABLE[op].bench in tune.KERNEL_BENCHES


def test_ssd_state_path_by_chunks():
    """The SSD scan's chunk-state path: fused for sequences of at most FUSED_MAX_CHUNKS chunks, split above; a fixed
    STATES is taken as is."""
    pytest.importorskip("triton")
    from ssmq.kernels.ssd import states_path

    cfg = configs.entry(json.loads(configs.path("ssd").read_text()), configs.DEFAULT)
    assert cfg["STATES"] == "by_chunks"
    edge = cfg["FUSED_MAX_CHUNKS"]
    assert states_path(1, cfg) == states_path(edge, cfg) == "fused" and states_path(edge + 1, cfg) == "split"
    assert states_path(1, {**cfg, "STATES": "split"}) == "split"
    assert states_path(99, {**cfg, "STATES": "fused"}) == "fused"
