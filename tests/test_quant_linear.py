import gzip

import pytest
import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.quant.calibration import attach_observers, load_calibration, run_calibration
from ssmq.quant.linear import QuantEmbedding, QuantLinear
from ssmq.quant.observers import MinMaxObserver
from ssmq.quant.primitives import PerChannel, PerGroup, PerTensor, PerToken, choose_qparams, dequantize, quantize
from ssmq.quant.spec import ActSpec, WeightSpec


def test_w8a8_forward_is_exact_integer_gemm():
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    q = QuantLinear.from_float(lin, WeightSpec("int8"), ActSpec("int8", PerToken(), static=False))
    x = torch.randn(3, 5, 64)
    x2 = x.reshape(-1, 64)
    s, _ = choose_qparams(x2, PerToken(), "int8")
    a = quantize(x2, s, None, PerToken(), "int8")
    acc = a.double() @ q.weight_q.double().T  # exact integers
    ref = acc.float() * (s.view(-1, 1) * q.weight_scale.view(1, -1)) + lin.bias
    assert torch.equal(q(x), ref.reshape(3, 5, 16))


@pytest.mark.parametrize("w,a", [("int8", None), ("int4", None), ("int4", "int8"), ("fp8", "fp8"), ("fp8", None)])
def test_quantlinear_close_to_float(w, a):
    torch.manual_seed(0)
    lin = nn.Linear(128, 32)
    gran = PerGroup(64) if w == "int4" else WeightSpec().granularity
    act = None if a is None else ActSpec(a, PerTensor(), static=True)
    x = torch.randn(4, 128)
    q = QuantLinear.from_float(lin, WeightSpec(w, gran), act, act_scale=x.abs().max() / (127 if a == "int8" else 448))
    tol = {"int8": 0.02, "int4": 0.15, "fp8": 0.08}[w]
    assert ((q(x) - lin(x)).norm() / lin(x).norm()).item() < tol
    assert all(isinstance(t, torch.Tensor) for t in q.state_dict().values())
    if w == "int4":
        assert q.weight_q.dtype == torch.uint8 and q.weight_q.shape == (32, 64)


def test_quant_embedding():
    e = nn.Embedding(50, 32)
    q = QuantEmbedding.from_float(e, WeightSpec("int4", PerGroup(16)))
    ids = torch.randint(0, 50, (2, 7))
    s, z = choose_qparams(e.weight, PerGroup(16), "int4")
    ref = dequantize(quantize(e.weight, s, z, PerGroup(16), "int4"), s, z, PerGroup(16))[ids]
    assert torch.equal(q(ids), ref)


def test_static_without_scale_refused():
    with pytest.raises(SSMQError):
        QuantLinear.from_float(nn.Linear(8, 8), WeightSpec("int8"), ActSpec("int8"))


def test_calibration_windows_and_hooks(tmp_path):
    from conftest import shared_or_skip

    shared_or_skip("tokenizers", "gpt-neox-20b")  # calibration text is tokenized with the GPT-NeoX tokenizer
    f = tmp_path / "t.txt.gz"
    with gzip.open(f, "wt") as g:
        g.write("The quick brown fox jumps over the lazy dog.\n" * 200)
    c1 = load_calibration(f, n_samples=6, seqlen=16, seed=3)
    c2 = load_calibration(str(f), n_samples=6, seqlen=16, seed=3)
    assert c1.input_ids.shape == (6, 16) and torch.equal(c1.input_ids, c2.input_ids)
    assert c1.record()["seed"] == 3 and c1.record()["source"] == str(f)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.proj = nn.Embedding(60000, 8), nn.Linear(8, 4)

        def forward(self, ids):
            return self.proj(self.emb(ids))

    m = M()
    hooks, obs = attach_observers(m, ["pro*"], lambda p, mod: MinMaxObserver())
    run_calibration(m, c1, batch_size=4, progress=False)
    hooks.remove()
    assert obs["proj"].count == 6 * 16 * 8
    with torch.no_grad():
        m.emb.weight[c1.input_ids[0, 0]] = float("nan")
    hooks, _ = attach_observers(m, ["proj"], lambda p, mod: MinMaxObserver())
    with pytest.raises(SSMQError, match="non-finite"):
        run_calibration(m, c1, progress=False)
    hooks.remove()
    with pytest.raises(SSMQError, match="not found"):
        load_calibration(tmp_path / "missing.txt")


def test_forward_runs_the_dispatched_ops(monkeypatch):
    """QuantLinear's forward is kernels.quant_linear_act (int8 / fp8 activations) or kernels.quant_linear
    (weight-only): the names CUDA routes to Triton."""
    from ssmq import kernels

    calls = []
    for name in ("quant_linear", "quant_linear_act", "quantize_act"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    lin = torch.nn.Linear(64, 8)
    m = QuantLinear.from_float(lin, WeightSpec("int4", PerGroup(32)), ActSpec("int8", PerToken(), static=False))
    m(torch.randn(3, 64))
    assert calls == ["quant_linear_act"]
    calls.clear()
    QuantLinear.from_float(lin, WeightSpec("int8", PerChannel()), None)(torch.randn(3, 64))
    assert calls == ["quant_linear"]


def test_kernel_module_does_not_shadow_the_op():
    # importing the Triton module must leave ssmq.kernels.quant_linear the dispatched function (a submodule of
    # that name once replaced it, and every quantized model on CUDA failed with "'module' object is not callable")
    pytest.importorskip("triton")
    import importlib

    from ssmq import kernels

    importlib.import_module("ssmq.kernels.quant_gemm")
    assert callable(kernels.quant_linear) and callable(kernels.quantize_act)
