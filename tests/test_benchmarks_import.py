"""Every benchmark script imports against today's package: the scripts run only on a GPU machine, so a renamed
or removed function would otherwise first fail there, costing device time (bench_quant.py once did)."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: a dataclass's string annotations resolve in its module
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError as e:  # an optional third-party package (a peer, matplotlib) is not a broken script
        if e.name and e.name.split(".")[0] == "ssmq":
            raise
        pytest.skip(f"{path.name} needs {e.name}")
    finally:
        sys.modules.pop(f"_bench_{path.stem}", None)


def test_kv_bench_limit_takes_the_card_s_bandwidth(monkeypatch):
    """bench_kvquant's "limit" columns: the datasheet bandwidth of the card it runs on (its H200 runs once took the
    H100's), and a card it does not know stops the run rather than print a wrong limit."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kvquant

    assert bench_kvquant.hbm_tbps("NVIDIA H200") == 4.8
    assert bench_kvquant.hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    with pytest.raises(SystemExit, match="no datasheet bandwidth"):
        bench_kvquant.hbm_tbps("NVIDIA A100-SXM4-80GB")


def test_kv_bench_shapes(monkeypatch):
    """bench_kvquant --shape: SmolLM2's and the hybrid's heads at head dim 64 and Bamba-9B's partial RoPE, with their
    1% outlier slots (2 x 1% / 1% of hkv x e channels, as ``KVQuantizer.outlier_slots``); an unknown shape stops
    the run."""
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kvquant

    try:
        bench_kvquant.set_shape("smollm2")
        assert (bench_kvquant.HQ, bench_kvquant.HKV, bench_kvquant.E, bench_kvquant.R) == (9, 3, 64, 64)
        assert bench_kvquant.ONE_PCT == (4, 2) and bench_kvquant.QUANT_ROWS[1][2] == (4, 2)
        bench_kvquant.set_shape("hybrid")
        assert bench_kvquant.R == 32 and bench_kvquant.ONE_PCT == (2, 1)
        bench_kvquant.set_shape("bamba")  # Bamba-9B: Llama-8B's heads, RoPE on 64 of the 128 channels
        assert (bench_kvquant.HQ, bench_kvquant.HKV, bench_kvquant.E, bench_kvquant.R) == (32, 8, 128, 64)
        assert bench_kvquant.ONE_PCT == (20, 10)
        with pytest.raises(SystemExit, match="unknown --shape"):
            bench_kvquant.set_shape("llama")
    finally:
        bench_kvquant.set_shape("8b")
    assert bench_kvquant.ONE_PCT == (20, 10)


def test_kv_bench_cache_keeps_a_share_of_key_slots_live(monkeypatch):
    """bench_kvquant.quant_cache(key_live=): a random share of each token's key slots holds an outlier (1% per-channel
    thresholds fill about half of their 2 x 1% slots), stored as quantization stores them (index order, empty slots
    -1 last); value slots all live; key_live=1 fills every slot."""
    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import bench_kvquant

    monkeypatch.setattr(bench_kvquant, "DEV", "cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = bench_kvquant.quant_cache(2, 64, 20, 10, gen, 4, key_live=0.5)
    live = k.out_idx >= 0
    assert 0.4 < live.float().mean() < 0.6 and (v.out_idx >= 0).all()
    assert not (live[..., 1:] & ~live[..., :-1]).any()  # the empty ones last
    idx = torch.where(live, k.out_idx.long(), 10 ** 6)
    assert (idx[..., 1:] >= idx[..., :-1]).all()
    k, _ = bench_kvquant.quant_cache(2, 64, 20, 10, gen, 4)
    assert (k.out_idx >= 0).all()


def test_paged_decode_plot_names_the_device(tmp_path, monkeypatch):
    """bench_paged_decode writes its PNG beside the JSON, titled with the GPU it ran on (it once said H100 for an
    H200 run)."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(BENCH))
    import bench_paged_decode

    rows = [{"format": f, "batch": 1, "context": 32768, "in place ms": 1.05, "contiguous ms": 1.0}
            for f in ("fp16", "4")]
    titles = []
    real = bench_paged_decode.pyplot()
    monkeypatch.setattr(real.Axes, "set_title", lambda self, t, *a, **k: titles.append(t), raising=False)
    bench_paged_decode.plot({32: rows}, tmp_path / "p.png", "NVIDIA H200")
    assert (tmp_path / "p.png").stat().st_size > 0 and titles and "NVIDIA H200" in titles[0]
