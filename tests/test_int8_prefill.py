"""A quantized model's prefill on the int8 path (the conv emitting the taps' codes, the int8-input scan:
``kernels.quant_ssd`` / ``kernels.quant_selective_scan``), which CUDA takes by default, against the fake-quant path CPU keeps (fake-quantized taps, the
float scan). Here the int8 path is forced on CPU, where it runs the references (``quant_ssd_ref``): the same codes
and scales, so the logits agree to float32 rounding (the references differ in where the scales multiply), and the
final SSM / conv states too."""

from __future__ import annotations

import pytest
import torch

from ssmq import kernels
from ssmq.kernels import dispatch
from ssmq.quant.ssm.state_cache import allocate_cache
from test_int8_decode import IDS, SLOTS, quantized

CASES = [("mamba2", "quamba2-w8a8", 8), ("mamba2", "quamba-w8a8", 16), ("mamba1", "quamba2-w8a8", 8),
         ("mamba1", "quamba-w8a8", 16)]
SCAN = {"mamba2": ("quant_ssd", "ssd_chunk_scan"), "mamba1": ("quant_selective_scan", "selective_scan")}


@torch.no_grad()
def prefill(model, bits, int8: bool, monkeypatch):
    monkeypatch.setattr(dispatch, "INT8_PREFILL", True)
    monkeypatch.setattr(kernels, "int8_prefill", lambda t: int8)
    cache = allocate_cache(model, 4, 32, ssm_dtype=torch.int8 if bits == 8 else None)
    logits = model(IDS[:, :12], cache, SLOTS)
    return logits, [s.clone() for s in cache.ssm_states if s is not None], [c.clone() for c in cache.conv_states
                                                                             if c is not None]


@pytest.mark.parametrize("arch,name,bits", CASES)
def test_int8_prefill_path_agrees_with_the_fake_quant_path(arch, name, bits, monkeypatch):
    model = quantized(arch, name, bits)
    old = prefill(model, bits, False, monkeypatch)
    new = prefill(model, bits, True, monkeypatch)
    torch.testing.assert_close(new[0], old[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(new[1], old[1]):  # int8 states may flip a code on a rounding tie
        assert (a.float() - b.float()).abs().max() <= (1 if bits == 8 else 1e-4)
    assert all(torch.equal(a, b) for a, b in zip(new[2], old[2]))


@pytest.mark.parametrize("arch", sorted(SCAN))
def test_the_int8_prefill_path_is_taken(arch, monkeypatch):
    quant_scan, float_scan = SCAN[arch]
    calls = []
    for name in ("conv1d_silu_quant", quant_scan):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **kw: (calls.append(_n), _fn(*a, **kw))[1])
    monkeypatch.setattr(kernels, float_scan, None)  # the float scan must not be called
    model = quantized(arch, "quamba2-w8a8", 8)
    prefill(model, 8, True, monkeypatch)
    layers = model.config.n_layer
    assert calls.count("conv1d_silu_quant") == layers and calls.count(quant_scan) == layers


@pytest.mark.gpu
@pytest.mark.parametrize("arch,name,bits", CASES)
def test_int8_prefill_on_the_kernels_agrees_with_the_fake_quant_path(arch, name, bits, monkeypatch):
    """Same with the fused conv + quantize and the int8-input SSD kernels (CUDA, or SSMQ_TRITON_INTERPRET=1)."""
    import copy

    from test_kernels import DEV, INTERPRET, _patch_interpreter_scalars, rel

    pytest.importorskip("triton")
    if INTERPRET:
        _patch_interpreter_scalars()
    from ssmq.kernels import conv1d, quant_gemm, scan, ssd

    model = copy.deepcopy(quantized(arch, name, bits)).to(DEV)
    monkeypatch.setattr("test_int8_prefill.IDS", IDS.to(DEV))
    monkeypatch.setattr("test_int8_prefill.SLOTS", SLOTS.to(DEV))
    old = prefill(model, bits, False, monkeypatch)
    monkeypatch.setattr(kernels, "conv1d_silu_quant", conv1d.conv1d_silu_quant)
    monkeypatch.setattr(kernels, "quant_ssd", ssd.quant_ssd_chunk_scan)
    monkeypatch.setattr(kernels, "quant_selective_scan", scan.quant_selective_scan)
    monkeypatch.setattr(kernels, "quantize_act", quant_gemm.quantize_act)  # Mamba-1's per-tensor B, C codes
    new = prefill(model, bits, True, monkeypatch)
    assert rel(new[0], old[0]) < 1e-4
    for a, b in zip(new[1], old[1]):
        diff = (a.float() - b.float()).abs()
        assert diff.max() <= (1 if bits == 8 else 1e-4)
