import pytest
import torch
import torch.nn as nn

from _quant_tiny import tiny_calib, tiny_model
from ssmq.quant.gptq import HessianAccumulator, gptq_quantize
from ssmq.quant.primitives import PerGroup, choose_qparams, dequantize, quantize
from ssmq.quant.rotation import rotate_model_
from ssmq.quant.smoothquant import apply_smoothing_, smoothing_scales
from ssmq.quant.spec import WeightSpec


def _layer_data(seed=0, k=256, n=64, N=1024):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)  # correlated channels
    X = (torch.randn(N, k, generator=g) @ mix) * (torch.rand(k, generator=g) * 4 + 0.1)
    return X, torch.randn(n, k, generator=g)


@pytest.mark.parametrize("spec", [WeightSpec("int4", PerGroup(128), method="gptq"),
                                  WeightSpec("int4", PerGroup(64), method="gptq", act_order=True),
                                  WeightSpec("int8", method="gptq")])
def test_gptq_beats_rtn(spec):
    X, W = _layer_data()
    acc = HessianAccumulator(X.shape[1])
    for chunk in X.split(300):
        acc.add(chunk)
    q, s, z = gptq_quantize(W, acc.H, spec)
    rs, rz = choose_qparams(W, spec.granularity, spec.dtype)
    rtn = dequantize(quantize(W, rs, rz, spec.granularity, spec.dtype), rs, rz, spec.granularity)
    err = lambda Wq: (X @ (W - Wq).T).norm().item()  # noqa: E731
    assert err(dequantize(q, s, z, spec.granularity)) < 0.9 * err(rtn)


def test_smoothquant_preserves_function():
    torch.manual_seed(0)
    norm_w = nn.Parameter(torch.rand(32) + 0.5)

    class Norm(nn.Module):
        weight = norm_w

    norm = Norm()
    lins = [nn.Linear(32, 16), nn.Linear(32, 8)]
    x = torch.randn(20, 32) * torch.linspace(0.1, 30, 32)
    ref = [l(x * norm.weight) for l in lins]
    s = smoothing_scales((x * norm.weight).abs().amax(0), [l.weight for l in lins], alpha=0.5)
    with torch.no_grad():
        apply_smoothing_(s, norm, lins)
    for l, r in zip(lins, ref):
        torch.testing.assert_close(l(x * norm.weight), r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid"])
def test_smoothquant_model_preserves_function(arch):
    from ssmq.quant.api import _smoothquant
    from ssmq.quant.recipe import get_recipe

    m = tiny_model(arch)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = m(ids)
        _smoothquant(m, get_recipe("smoothquant-w8a8"), 0.5, tiny_calib(), {"progress": False})
        out = m(ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5


@pytest.mark.parametrize("arch", ["mamba1", "mamba2", "hybrid"])
def test_hadamard_rotated_model_equals_float(arch):
    m = tiny_model(arch)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = m(ids)
        rotate_model_(m, online=True)
        out = m(ids)
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-5
