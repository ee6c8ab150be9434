"""W4AX mixed precision: the evolutionary search, its baselines, and the quamba2-mixed recipe end to end."""

import torch

from ssmq.quant import Search, get_recipe, quantize
from ssmq.quant.ssm.mixed import a16_count, evolutionary_search, hc_first, hc_last, window_ppl
from tiny_ssm import synthetic_calibration, tiny_model


def test_search_finds_the_best_assignment_and_keeps_the_ratio():
    n, k = 12, a16_count(12, (3, 1))
    assert k == 3
    sensitive = {2, 7, 11}  # layers that gain most from A16
    calls = []

    def fitness(g):
        calls.append(g)
        assert g.count(0) == k
        return sum(1.0 + (5.0 if i in sensitive else 0.0) for i, v in enumerate(g) if v)

    out = evolutionary_search(n, k, fitness, population=40, generations=5, mutations=10, crossovers=10, seed=0)
    assert [i for i, v in enumerate(out["best"]) if not v] == sorted(sensitive)
    assert len(calls) == len(set(calls)) == out["evaluated"]  # memoised
    assert out["history"] == sorted(out["history"], reverse=True)  # best-so-far never worsens
    assert hc_first(6, 2) == (0, 0, 1, 1, 1, 1) and hc_last(6, 2) == (1, 1, 1, 1, 0, 0)


def test_quamba2_mixed_on_a_tiny_model():
    calib = synthetic_calibration(64, 6, 32)
    heldout = synthetic_calibration(64, 2, 32, seed=3)
    recipe = get_recipe("quamba2-mixed").with_changes(
        search=Search(population=4, generations=2, mutations=2, crossovers=2))
    model = quantize(tiny_model("mamba2"), recipe, calib, heldout=heldout, progress=False)
    info = model.quantization["mixed"]
    assert info["assignment"].count("A16") == 1 and len(info["assignment"]) == 4
    assert info["fitness_ppl"] <= min(info["baselines_ppl"].values()) + 1e-9  # exhaustive here (4 genomes)
    assert abs(window_ppl(model, heldout.input_ids) - info["fitness_ppl"]) < 1e-6 * info["fitness_ppl"]
    assert torch.isfinite(model(heldout.input_ids)).all()
