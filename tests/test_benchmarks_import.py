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
