"""Activation quantization fused into the op that produces an A8 linear's input (``kernels.rms_norm_quant``,
``rmsnorm_gated_quant``; ``KernelPolicy.act_quant_fusion``; the prototype ``hadamard_quant``): the kernels compile
for sm_90, and quantized models give the same logits with the fusion as without it (bit for bit on CPU). The
kernels' arithmetic: ``test_act_quant_kernels.py`` (GPU / interpreter).
"""

from __future__ import annotations

import pytest
import torch

from ssmq.ops.hadamard import hadamard_quant_ref, hadamard_transform
from ssmq.ops.quant_linear import quantize_act_ref


def test_hadamard_quant_reference_is_the_unfused_pair():
    """On CPU the reference is exactly what an unfused rotated A8 linear quantizes: the butterflies, then codes."""
    x = torch.randn(3, 5120).half()
    q, s = hadamard_quant_ref(x)
    q2, s2 = quantize_act_ref(hadamard_transform(x))
    assert torch.equal(q, q2) and torch.equal(s, s2)



# --- the kernels compile for an H100 (sm_90) without a GPU: what the interpreter cannot check ---------------------

@pytest.mark.parametrize("static,dtype,fp8", [(False, "fp16", False), (True, "bf16", False), (False, "fp16", True)])
def test_norm_quant_kernels_compile_for_sm90(static, dtype, fp8):
    from test_kernel_compile import _compile_sm90

    from ssmq.kernels import norm

    codes = "fp8e4nv" if fp8 else "i8"
    _compile_sm90(norm._rms_norm, {"x_ptr": dtype, "res_ptr": "fp32", "w_ptr": dtype, "out_ptr": dtype,
                                   "res_out_ptr": "fp32", "q_ptr": codes, "scale_ptr": "fp32"},
                  dict(HAS_RES=True, QUANT=True, STATIC=static, BLOCK=4096, USE_GDC=static, FP8=fp8), floats=("eps",),
                  num_warps=16)
    for one in (True, False):
        _compile_sm90(norm._rmsnorm_gated_quant, {"x_ptr": dtype, "z_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype,
                                                  "q_ptr": codes, "scale_ptr": "fp32", "zs_ptr": "fp32"},
                      dict(HAS_Z=True, NORM_BEFORE_GATE=False, STORE_OUT=True, STATIC=static, ONE_GROUP=one,
                           BLOCK=8192 if one else 2048, Z_QUANT=static, USE_GDC=static, FP8=fp8), floats=("eps",),
                      num_warps=16 if one else 8)


@pytest.mark.parametrize("gated,dtype,work,bt,br,warps", [(False, "fp16", "fp16", 64, 128, 8),
                                                          (True, "bf16", "fp32", 64, 128, 4),
                                                          (True, "fp16", "fp16", 64, 128, 16),  # shipped: 5120 wide
                                                          (True, "fp16", "fp16", 16, 16, 4)])
def test_hadamard_quant_compiles_for_sm90(gated, dtype, work, bt, br, warps):
    from test_kernel_compile import _compile_sm90

    from ssmq.kernels import hadamard

    _compile_sm90(hadamard._hadamard_quant, {"x_ptr": dtype, "z_ptr": dtype, "w_ptr": dtype, "l_ptr": work,
                                             "r_ptr": work, "q_ptr": "i8", "scale_ptr": "fp32", "y_ptr": dtype,
                                             "zs_ptr": "fp32"},
                  dict(T=bt, R=br * 5 // 8, GATED=gated, HAS_Z=True, Z_QUANT=gated, STORE_Y=True,
                       PRECISION="ieee" if work == "fp32" else "tf32", BT=bt, BR=br, TT=min(64, bt), RT=16,
                       USE_GDC=gated), floats=("eps",), num_warps=warps)


# --- wiring: quantized models give the same logits with and without the fusion (CPU: bit for bit) ------------------

CASES = [("mamba2", "static-w8a8"), ("mamba2", "dynamic-w8a8"), ("mamba2", "quamba2-w8a8"), ("mamba1", "quamba-w8a8"),
         ("mamba1", "dynamic-w8a8"), ("mamba2", "ssdi8-w8a8"), ("mamba2", "fp8-w8a8"), ("mamba1", "fp8-w8a8")]
# A8 linears whose float input is still quantized by the linear itself when the fusion is on, per layer and pass:
# Mamba-1's x_proj (its input is the conv's output) and out_proj (the scan's output); Mamba-2's rotated out_proj
# (Quamba2, SSDi8: static scales) takes the codes of its rotated input from the gated norm
UNFUSED = {("mamba1", "quamba-w8a8"): 2, ("mamba1", "dynamic-w8a8"): 2, ("mamba1", "fp8-w8a8"): 2}


def _run(model, ids, steps):
    """Prefill logits, then ``steps`` decode steps on a cache: (prefill logits, (steps, b, vocab) step logits)."""
    b, l = ids.shape
    cache = model.allocate_cache(b, l + steps)
    out = [model(ids, cache)]
    tok = out[0][:, -1].argmax(-1)
    steps_out = []
    for _ in range(steps):
        logits = model.step(tok, cache)
        steps_out.append(logits)
        tok = logits.argmax(-1)
    return out[0], torch.stack(steps_out)


def _compare(monkeypatch, model, ids, steps=3):
    """Logits with the fusion off and on (identical); returns the float-input A8 linear calls with it off and on."""
    from ssmq import kernels
    from ssmq.kernels import policy

    calls = []
    real = kernels.quant_linear_act
    monkeypatch.setattr(kernels, "quant_linear_act", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        with policy.using(policy.KernelPolicy(act_quant_fusion=False)):
            off = _run(model, ids, steps)
        unfused_calls = len(calls)
        calls.clear()
        on = _run(model, ids, steps)
    for a, b in zip(off, on):
        assert torch.equal(a, b), (a - b).abs().max()
    return unfused_calls, len(calls)


@pytest.mark.parametrize("arch,recipe", CASES)
def test_fused_activation_quantization_is_bit_identical(monkeypatch, arch, recipe):
    from ssmq.quant.api import quantize
    from tiny_ssm import synthetic_calibration, tiny_model

    model = tiny_model(arch)
    model = quantize(model, recipe, synthetic_calibration(model.config.vocab_size, n=4, seqlen=16), progress=False)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    before, after = _compare(monkeypatch, model, ids)
    passes = 1 + 3  # prefill + decode steps
    n_layer = model.config.n_layer
    assert before >= 2 * n_layer * passes  # in_proj and out_proj of every layer quantized their own input
    assert after == UNFUSED.get((arch, recipe), 0) * n_layer * passes


@pytest.mark.parametrize("arch,recipe", [("mamba2", "static-w8a8"), ("mamba2", "dynamic-w8a8"),
                                         ("mamba2", "quamba2-w8a8"), ("mamba1", "quamba-w8a8")])
def test_fused_activation_quantization_reference_models(monkeypatch, arch, recipe):
    """The trained reference models (``../shared/models``): the fusion leaves their logits bit for bit unchanged."""
    from conftest import shared_or_skip

    from ssmq.models.loading import load_model
    from ssmq.quant.api import quantize
    from tiny_ssm import synthetic_calibration

    model = load_model(shared_or_skip("models", arch))
    vocab = model.config.vocab_size
    model = quantize(model, recipe, synthetic_calibration(vocab, n=2, seqlen=32), progress=False)
    ids = torch.randint(0, vocab, (1, 24), generator=torch.Generator().manual_seed(4))
    before, after = _compare(monkeypatch, model, ids, steps=2)
    assert after < before


def test_z_quantizer_runs_inside_the_gated_norm(monkeypatch):
    """Quamba2's act_z quantizer before a rotated out_proj (the norm hands it the codes of its rotated output): z is
    fake-quantized inside the gated norm's kernel, one kernel a layer and pass fewer, with the logits of the quantizer
    run on its own and of out_proj rotating and quantizing its own input bit for bit (CPU)."""
    from ssmq import kernels
    from ssmq.models.mamba2 import Mamba2Mixer
    from ssmq.models.quant_taps import is_quantizer
    from ssmq.quant.api import quantize
    from tiny_ssm import synthetic_calibration, tiny_model

    model = tiny_model("mamba2")
    model = quantize(model, "quamba2-w8a8", synthetic_calibration(model.config.vocab_size, n=4, seqlen=16),
                     progress=False)
    mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    assert mixers and all(is_quantizer(m.act_z) and m._out_codes().rotate for m in mixers)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    calls = []
    real = kernels.fake_quantize
    monkeypatch.setattr(kernels, "fake_quantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with torch.no_grad():
        fused = _run(model, ids, 3)
        fused_calls = len(calls)
        calls.clear()
        monkeypatch.setattr(Mamba2Mixer, "_normed", lambda self, y, z: self.act_y(self.norm(y, self.act_z(z))))
        apart = _run(model, ids, 3)
    for a, b in zip(fused, apart):
        assert torch.equal(a, b), (a - b).abs().max()
    assert len(calls) - fused_calls == len(mixers) * (1 + 3)  # act_z's own pass, every layer, prefill + 3 steps
