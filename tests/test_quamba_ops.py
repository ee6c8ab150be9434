"""The int8 SSM references equal "dequantize, then the float reference"; the int8 state round trip is bounded."""

import torch

from ssmq import ops
from ssmq.ops.quant_ssm import (
    conv1d_silu_quant_ref,
    dequantize_ref,
    fake_quantize_ref,
    dequantize_state_ref,
    quant_selective_scan_ref,
    quant_ssd_ref,
    quant_state_update_ref,
    quantize_ref,
    quantize_state_ref,
    rms_norm_quant_ref,
)

g = torch.Generator().manual_seed(0)


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def codes(*shape):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)


def close(a, b, tol=1e-5):
    assert (a - b).abs().max() <= tol * (1 + b.abs().max()), (a - b).abs().max()


def test_quant_selective_scan_equals_dequantized_float_scan():
    b, d, n, l = 2, 6, 4, 7
    u_q, dt_q, z_q = codes(b, d, l), codes(b, d, l), codes(b, d, l)
    B_q, C_q = codes(b, n, l), codes(b, n, l)
    s_u, s_B, s_C = rnd(d, 1).abs() / 100, rnd(n, 1).abs() / 100, rnd(n, 1).abs() / 100  # per channel / state
    s_dt, s_z = torch.tensor(0.01), torch.tensor(0.02)
    A, D, bias = -rnd(d, n).abs(), rnd(d), rnd(d)
    h0 = rnd(b, d, n)
    y, last = quant_selective_scan_ref(u_q, s_u, dt_q, s_dt, A, B_q, s_B, C_q, s_C, D, z_q, s_z, bias, True, h0, True)
    ref, ref_last = ops.selective_scan_ref(
        dequantize_ref(u_q, s_u), dequantize_ref(dt_q, s_dt), A, dequantize_ref(B_q, s_B), dequantize_ref(C_q, s_C),
        D, dequantize_ref(z_q, s_z), bias, True, h0, True)
    close(y, ref)
    close(last, ref_last)


def test_quant_ssd_equals_dequantized_float_ssd():
    b, l, h, p, gr, n, k = 2, 13, 4, 3, 2, 8, 2
    x_q, B_q, C_q = codes(b, l, h, p), codes(b, l, gr, n), codes(b, l, gr, n)
    s_x, s_B, s_C = rnd(h, p).abs() / 100, rnd(gr, k).abs() / 100, rnd(gr, k).abs() / 100
    dt, A, D, bias, h0 = rnd(b, l, h), -rnd(h).abs(), rnd(h), rnd(h), rnd(b, h, p, n)
    y, last = quant_ssd_ref(x_q, s_x, dt, A, B_q, s_B, C_q, s_C, 4, D, bias, True, initial_states=h0,
                            return_final_states=True)
    expand = lambda s: s.repeat_interleave(n // k, -1)  # (g, k) -> (g, n)  # noqa: E731
    args = (dequantize_ref(x_q, s_x), dt, A, dequantize_ref(B_q, expand(s_B)), dequantize_ref(C_q, expand(s_C)))
    ref, ref_last = ops.ssd_chunk_scan_ref(*args, 4, D=D, dt_bias=bias, dt_softplus=True, initial_states=h0,
                                           return_final_states=True)
    seq = ops.ssd_sequential_ref(*args, D=D, dt_bias=bias, dt_softplus=True, initial_states=h0)
    close(y, ref)
    close(y, seq)
    close(last, ref_last)


def test_fused_conv_and_norm_quantize_as_their_float_parts():
    x, w, bias, s = rnd(2, 5, 9), rnd(5, 4), rnd(5), rnd(5, 1).abs() / 50
    q, final = conv1d_silu_quant_ref(x, w, bias, s, return_final_states=True)
    y, ref_final = ops.causal_conv1d_ref(x, w, bias, None, True, "silu")
    assert torch.equal(q, quantize_ref(y, s)) and torch.equal(final, ref_final)
    for dtype in (torch.float32, torch.float16):  # fake_quant: the taps' output (each channel's scale), not codes
        values = conv1d_silu_quant_ref(x.to(dtype), w.to(dtype), bias.to(dtype), s, fake_quant=True)
        yd = ops.causal_conv1d_ref(x.to(dtype), w.to(dtype), bias.to(dtype), None, False, "silu")
        assert values.dtype == dtype
        assert torch.equal(values, fake_quantize_ref(yd.transpose(1, 2), s.reshape(-1)).transpose(1, 2))
    h, res, nw = rnd(2, 3, 16), rnd(2, 3, 16), rnd(16)
    q, r = rms_norm_quant_ref(h, nw, 1e-5, res, True, torch.tensor(0.03))
    out, ref_r = ops.rms_norm_ref(h, nw, 1e-5, res, True)
    assert torch.equal(q, quantize_ref(out, torch.tensor(0.03))) and torch.equal(r, ref_r)


def test_int8_state_round_trip_is_bounded():
    s, h, p, n, G = 3, 4, 8, 16, 5
    index = torch.randint(0, G, (h * p,), generator=g)
    state = rnd(s, h, p, n)
    amax = torch.zeros(G, n).scatter_reduce(0, index[:, None].expand(-1, n),
                                            state.abs().reshape(s, h * p, n).amax(0), "amax")
    scale = amax / 127
    back = dequantize_state_ref(quantize_state_ref(state, scale, index), scale, index)
    bound = scale[index].reshape(h, p, n) / 2 + 1e-7  # half a step, nothing clipped (scales from absmax)
    assert ((back - state).abs() <= bound).all()
    # Mamba-1 layout (s, d, n), per-tensor groups
    st1 = rnd(s, 6, n)
    sc1 = st1.abs().amax((0, 1))[None] / 127
    assert ((dequantize_state_ref(quantize_state_ref(st1, sc1), sc1) - st1).abs() <= sc1 / 2 + 1e-7).all()


def test_decode_step_reads_and_writes_int8_state():
    s, b, h, p, gr, n = 4, 2, 4, 3, 2, 8
    scale, index = torch.full((2, n), 0.02), torch.arange(h * p) % 2
    state_q = codes(s, h, p, n)
    slots = torch.tensor([3, 1])
    x_q, B_q, C_q = codes(b, h, p), codes(b, gr, n), codes(b, gr, n)
    sx, sB, sC = torch.tensor(0.01), torch.tensor(0.02), torch.tensor(0.03)
    dt, A, D = rnd(b, h, p), -rnd(h, p, n).abs(), rnd(h, p)
    float_state = dequantize_state_ref(state_q, scale, index)
    before = state_q.clone()
    y = quant_state_update_ref(state_q, scale, index, x_q, sx, dt, A, B_q, sB, C_q, sC, D, None, None, True, slots)
    ref = ops.selective_state_update_ref(float_state, dequantize_ref(x_q, sx), dt, A, dequantize_ref(B_q, sB),
                                         dequantize_ref(C_q, sC), D, None, None, True, slots)
    close(y, ref)
    assert state_q.dtype == torch.int8
    assert torch.equal(state_q, quantize_state_ref(float_state, scale, index))  # rows written re-quantized
    assert torch.equal(state_q[[0, 2]], before[[0, 2]])  # other slots untouched
