"""The integer conv1d (int8 weight codes, int8 input codes, int32 sums, one float32 rescale + bias + SiLU):
``ssmq.ops.conv1d``'s references against the float conv of the dequantized values, the decode step against the
prefill, and the Triton kernels against the references (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.ops.conv1d import ConvInt8, causal_conv1d_ref, causal_conv1d_update_ref
from ssmq.ops.quant_linear import dequantize_ref, quantize_ref
from ssmq.ops.quant_ssm import conv1d_silu_quant_ref, conv1d_update_silu_quant_ref
from test_kernels import DEV, INTERPRET, kernel_module


def _case(d, w, per_channel, int8_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    wf = torch.randn(d, w, generator=g) * 0.3
    ws = (wf.abs().amax(1) / 127) if per_channel else wf.abs().max() / 127
    wq = quantize_ref(wf, ws[:, None] if per_channel else ws)
    bf = torch.randn(d, generator=g) * 0.1
    bs = bf.abs().max() / 127 if int8_bias else None
    bias = quantize_ref(bf, bs) if int8_bias else bf
    return wq, bias, ConvInt8(ws, torch.tensor(0.03), bs), g


def _dequantized(wq, bias, q: ConvInt8):
    w = dequantize_ref(wq, q.weight_scale[:, None] if q.weight_scale.dim() else q.weight_scale)
    return w, (bias.float() if q.bias_scale is None else dequantize_ref(bias, q.bias_scale))


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("int8_bias", [False, True])
def test_integer_conv_is_the_float_conv_of_the_dequantized_codes(per_channel, int8_bias):
    """The integer sum is exact, so the only difference from a float conv of the dequantized input and weight codes
    is float32 rounding (documented in ``ssmq.ops.conv1d``): within a few ulps of the outputs' scale."""
    b, d, l, w = 2, 24, 9, 4
    wq, bias, q, g = _case(d, w, per_channel, int8_bias)
    x = torch.randn(b, d, l, generator=g)
    init = torch.randn(b, d, w - 1, generator=g)
    got, final = causal_conv1d_ref(x, wq, bias, init, True, activation="silu", int8=q)
    xd = dequantize_ref(quantize_ref(x, q.act_scale), q.act_scale)
    initd = dequantize_ref(quantize_ref(init, q.act_scale), q.act_scale)
    wd, bd = _dequantized(wq, bias, q)
    want = causal_conv1d_ref(xd, wd, bd, initd, activation="silu")
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert torch.equal(final, x[..., -(w - 1):])  # the state keeps the float inputs


@pytest.mark.parametrize("per_channel", [False, True])
def test_integer_decode_steps_equal_the_integer_prefill(per_channel):
    b, d, l, w = 3, 16, 6, 4
    wq, bias, q, g = _case(d, w, per_channel, True, seed=1)
    x = torch.randn(b, d, l, generator=g)
    want = causal_conv1d_ref(x, wq, bias, int8=q)
    state = torch.zeros(b, d, w - 1)
    steps = torch.stack([causal_conv1d_update_ref(x[..., t], state, wq, bias, int8=q) for t in range(l)], -1)
    assert torch.equal(steps, want)  # the same integer sums, the same float32 epilogue (before SiLU)
    want = causal_conv1d_ref(x, wq, bias, activation="silu", int8=q)
    codes = conv1d_silu_quant_ref(x, wq, bias, torch.tensor(0.01), int8=q)
    assert torch.equal(codes, quantize_ref(want, torch.tensor(0.01)))


def test_integer_conv_refuses_float_weights_and_bad_scales():
    wq, bias, q, _ = _case(8, 4, False, False)
    with pytest.raises(SSMQError, match="int8 weight codes"):
        causal_conv1d_ref(torch.randn(1, 8, 3), wq.float(), bias, int8=q)
    with pytest.raises(SSMQError, match="weight scale"):
        causal_conv1d_ref(torch.randn(1, 8, 3), wq, bias, int8=ConvInt8(torch.ones(3), torch.tensor(1.0)))


# ---------------------------------------------------------------------------------------------
# the Triton kernels
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def CV():
    return kernel_module("conv1d")


def _dev(*ts):
    return [t if t is None else t.to(DEV) for t in ts]


def _qdev(q: ConvInt8) -> ConvInt8:
    return ConvInt8(*_dev(q.weight_scale, q.act_scale, q.bias_scale))


SHAPES = [(2, 40, 7, 4)] if INTERPRET else [(2, 1000, 37, 4), (1, 5376, 300, 4), (3, 64, 1, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("b,d,l,w", SHAPES)
@pytest.mark.parametrize("per_channel,int8_bias", [(False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_prefill_kernel_equals_reference(CV, b, d, l, w, per_channel, int8_bias, dtype):
    wq, bias, q, g = _case(d, w, per_channel, int8_bias, seed=2)
    x, init = torch.randn(b, d, l, generator=g).to(dtype), torch.randn(b, d, w - 1, generator=g).to(dtype)
    want, want_final = causal_conv1d_ref(x, wq, bias, init, True, activation="silu", int8=q)
    got, final = CV.causal_conv1d(*_dev(x, wq, bias, init), True, activation="silu", int8=_qdev(q))
    assert torch.equal(final.cpu(), want_final)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # SiLU's exp; fp16 outputs round once
    assert (got.cpu().float() - want.float()).abs().max() <= tol * want.float().abs().max()
    codes = CV.conv1d_silu_quant(*_dev(x, wq, bias), torch.tensor(0.01, device=DEV), int8=_qdev(q))
    diff = (codes.cpu().int() - conv1d_silu_quant_ref(x, wq, bias, torch.tensor(0.01), int8=q).int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel,int8_bias", [(False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_update_kernel_equals_reference(CV, per_channel, int8_bias, dtype):
    b, s, d, w = (3, 5, 40, 4) if INTERPRET else (33, 64, 5376, 4)
    wq, bias, q, g = _case(d, w, per_channel, int8_bias, seed=3)
    x, state = torch.randn(b, d, generator=g).to(dtype), torch.randn(s, d, w - 1, generator=g).to(dtype)
    slots = torch.randperm(s, generator=g)[:b].to(torch.int32)
    want_state = state.clone()
    want = causal_conv1d_update_ref(x, want_state, wq, bias, "silu", slots, int8=q)
    dev_state = state.to(DEV)
    got = CV.causal_conv1d_update(*_dev(x), dev_state, *_dev(wq, bias), "silu", slots.to(DEV), int8=_qdev(q))
    assert torch.equal(dev_state.cpu(), want_state)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert (got.cpu().float() - want.float()).abs().max() <= tol * want.float().abs().max()
    state2, want_state2 = state.to(DEV), state.clone()
    want_q, want_deq = conv1d_update_silu_quant_ref(x, want_state2, wq, bias, torch.tensor(0.01), slots, True, int8=q)
    got_q, got_deq = CV.conv1d_update_silu_quant(*_dev(x), state2, *_dev(wq, bias), torch.tensor(0.01, device=DEV),
                                                 slots.to(DEV), True, int8=_qdev(q))
    diff = (got_q.cpu().int() - want_q.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-2
    assert torch.equal(got_deq.cpu(), (got_q.cpu().float() * 0.01).to(dtype))
