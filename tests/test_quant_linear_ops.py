"""CPU references of the quantized linear op (``ssmq.ops.quant_linear``): exact integer semantics, the
weight formats read off the tensors, and one-line errors on bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmq.errors import SSMQError
from ssmq.ops.quant_linear import dequantize_weight, quant_linear_ref, quantize_act_ref
from ssmq.quant.primitives import (
    PerChannel,
    PerGroup,
    PerTensor,
    PerToken,
    choose_qparams,
    dequantize,
    pack_int4,
    quantize,
)


def _codes(n, k, bits):
    lim = 8 if bits == 4 else 128
    return torch.randint(-lim, lim, (n, k), dtype=torch.int8)


def _pow2_scales(shape):
    # powers of two: every epilogue product and sum below is exact, so the float64 result is the answer
    return torch.pow(2.0, torch.randint(-8, -2, shape).float())


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 256])
@pytest.mark.parametrize("bits,group", [(8, None), (8, 0), (4, 64), (4, 32), (8, 16)])
@pytest.mark.parametrize("k", [37, 128, 320])
def test_integer_path_exact(rows, bits, group, k):
    if (group and k % group) or (bits == 4 and k % 2):
        pytest.skip("format needs k divisible by the group / even")
    torch.manual_seed(rows * k)
    n = 24
    codes = _codes(n, k, bits)
    w_s = _pow2_scales((n, k // group) if group else (n,) if group is None else ())
    x_q = torch.randint(-128, 128, (rows, k), dtype=torch.int8)
    x_s = _pow2_scales((rows,))
    bias = _pow2_scales((n,))
    out = quant_linear_ref(x_q, pack_int4(codes) if bits == 4 else codes, w_s, None, x_s, bias)
    w64 = codes.double() * (w_s.double().repeat_interleave(group, 1) if group else
                            w_s.double().reshape(-1, 1) if group is None else w_s.double())
    expect = (x_q.double() * x_s.double()[:, None]) @ w64.T + bias.double()
    assert out.dtype == torch.float32 and torch.equal(out.double(), expect)


@pytest.mark.parametrize("bits,gran,sym", [(8, PerChannel(0), True), (8, PerChannel(0), False), (8, PerTensor(), True),
                                           (4, PerGroup(128), True), (4, PerGroup(128), False), (4, PerGroup(32), False)])
@pytest.mark.parametrize("rows", [1, 5, 256])
def test_weight_only_is_dequantize_then_float(bits, gran, sym, rows):
    torch.manual_seed(rows)
    w = torch.randn(48, 256)
    qt = "int4" if bits == 4 else "int8"
    scale, zero = choose_qparams(w, gran, qt, sym)
    codes = quantize(w, scale, zero, gran, qt)
    w_q = pack_int4(codes) if bits == 4 else codes
    x, bias = torch.randn(rows, 256).half(), torch.randn(48).half()
    out = quant_linear_ref(x.float(), w_q, scale, zero, None, bias.float())
    deq = dequantize(codes, scale, zero, gran)  # primitives' own dequantize: an independent formula
    assert torch.equal(dequantize_weight(w_q, scale, zero), deq)
    assert torch.equal(out, F.linear(x.float(), deq, bias.float()))
    assert quant_linear_ref(x, w_q, scale, zero, None, bias).dtype == torch.float16


@pytest.mark.parametrize("per_token,static", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("qt", ["int8", "fp8"])
def test_quantize_act_matches_primitives(per_token, static, qt):
    torch.manual_seed(0)
    x = torch.randn(9, 40) * torch.rand(9, 1) * 3
    x[2] = 0.0
    gran = PerToken() if per_token else PerTensor()
    ref_s = torch.tensor(0.02) if static else choose_qparams(x, gran, qt)[0]
    dtype = torch.int8 if qt == "int8" else torch.float8_e4m3fn
    q, s = quantize_act_ref(x, ref_s if static else None, per_token, dtype)
    assert torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.int8), quantize(x, ref_s, None, gran, qt).view(torch.int8))


def test_fp8_path():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    w_s = w.abs().amax(1) / 448
    w_q = (w / w_s[:, None]).to(torch.float8_e4m3fn)
    x_q, x_s = quantize_act_ref(torch.randn(3, 64), None, True, torch.float8_e4m3fn)
    out = quant_linear_ref(x_q, w_q, w_s, None, x_s)
    expect = (x_q.double() * x_s.double()[:, None]) @ (w_q.double() * w_s.double()[:, None]).T
    # float32 products of exact fp8 values: only the summation order (the BLAS build's) differs from float64
    assert (out.double() - expect).norm() / expect.norm() < 1e-6


def test_errors():
    w8, s8 = torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    x = torch.randn(2, 8)
    with pytest.raises(SSMQError, match="features"):
        quant_linear_ref(torch.randn(2, 9), w8, s8)
    with pytest.raises(SSMQError, match="int8, uint8"):
        quant_linear_ref(x, w8.short(), s8)
    with pytest.raises(SSMQError, match="fit neither"):
        quant_linear_ref(x, w8, torch.ones(3))
    with pytest.raises(SSMQError, match="per-group"):
        quant_linear_ref(x, w8, torch.ones(4, 3))
    with pytest.raises(SSMQError, match="float32"):
        quant_linear_ref(x, w8, s8.half())
    with pytest.raises(SSMQError, match="x_scale"):
        quant_linear_ref(x.to(torch.int8), w8, s8)
    with pytest.raises(SSMQError, match="symmetric"):
        quant_linear_ref(x.to(torch.int8), w8, s8, torch.zeros(4, dtype=torch.int32), torch.ones(()))
    with pytest.raises(SSMQError, match="fp8 weights"):
        quant_linear_ref(x.to(torch.float8_e4m3fn), w8, s8, None, torch.ones(()))
    with pytest.raises(SSMQError, match="zero points"):
        quant_linear_ref(x, w8, s8, torch.zeros(4))
    with pytest.raises(SSMQError, match="bias"):
        quant_linear_ref(x, w8, s8, bias=torch.zeros(5))
    with pytest.raises(SSMQError, match="per-tensor"):
        quantize_act_ref(x, torch.ones(3))  # neither () nor one a row of x (2, 8)
    with pytest.raises(SSMQError, match="per-tensor"):  # a row's scale needs per_token
        quantize_act_ref(x, torch.ones(x.shape[0]), per_token=False)
