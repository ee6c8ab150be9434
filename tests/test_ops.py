"""The ops/ references agree with each other: chunked vs sequential SSD, prefill vs decode of every op."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from ssmq import ops
from ssmq.kernels import dispatch


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("l,chunk,g,d_shape,limit", [
    (37, 8, 2, "h", (0.0, math.inf)),
    (16, 16, 1, "hp", (0.0, math.inf)),
    (5, 8, 4, "h", (0.01, 0.5)),
])
def test_ssd_chunked_equals_sequential(l, chunk, g, d_shape, limit):
    b, h, p, n = 2, 4, 8, 16
    r = gen(0)
    x, dt, z = torch.randn(b, l, h, p, generator=r), torch.randn(b, l, h, generator=r), torch.randn(b, l, h, p, generator=r)
    A = -torch.rand(h, generator=r) * 3
    B, C = torch.randn(b, l, g, n, generator=r), torch.randn(b, l, g, n, generator=r)
    D = torch.randn(h, generator=r) if d_shape == "h" else torch.randn(h, p, generator=r)
    kw = dict(D=D, z=z, dt_bias=torch.randn(h, generator=r), dt_softplus=True, dt_limit=limit,
              initial_states=torch.randn(b, h, p, n, generator=r), return_final_states=True)
    y1, s1 = ops.ssd_chunk_scan_ref(x, dt, A, B, C, chunk, **kw)
    y2, s2 = ops.ssd_sequential_ref(x, dt, A, B, C, **kw)
    torch.testing.assert_close(y1, y2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)


def test_ssd_state_rows_continue_cache_rows_in_place():
    """state_rows: the scan starts from cache rows and leaves its final states there (in the cache's dtype), equal
    to gathering initial states and scattering the final ones; rows not served are untouched."""
    b, l, h, p, g, n, s = 2, 21, 4, 8, 2, 16, 5
    r = gen(3)
    x, dt = torch.randn(b, l, h, p, generator=r), torch.randn(b, l, h, generator=r)
    A = -torch.rand(h, generator=r) * 3
    B, C = torch.randn(b, l, g, n, generator=r), torch.randn(b, l, g, n, generator=r)
    kw = dict(D=torch.randn(h, generator=r), dt_bias=torch.randn(h, generator=r), dt_softplus=True)
    cache = torch.randn(s, h, p, n, generator=r).to(torch.bfloat16)
    rows = torch.tensor([3, 1])
    y, final = ops.ssd_chunk_scan_ref(x, dt, A, B, C, 8, **kw, initial_states=cache[rows], return_final_states=True)
    got = cache.clone()
    assert torch.equal(ops.ssd_chunk_scan_ref(x, dt, A, B, C, 8, **kw, state_rows=(got, rows)), y)
    assert torch.equal(got[rows], final.to(torch.bfloat16))
    assert torch.equal(got[[0, 2, 4]], cache[[0, 2, 4]])


@pytest.mark.parametrize("bad", ["initial", "final", "int8", "strided", "int32-rows", "short-rows"])
def test_ssd_state_rows_refuse_what_they_cannot_honour(bad):
    b, l, h, p, n = 2, 4, 2, 4, 8
    x, dt, A = torch.randn(b, l, h, p), torch.rand(b, l, h), -torch.rand(h)
    B = C = torch.randn(b, l, 1, n)
    states, rows, kw = torch.zeros(3, h, p, n), torch.tensor([0, 2]), {}
    if bad == "initial":
        kw["initial_states"] = torch.zeros(b, h, p, n)
    elif bad == "final":
        kw["return_final_states"] = True
    elif bad == "int8":
        states = states.to(torch.int8)
    elif bad == "strided":
        states = torch.zeros(3, h, n, p).transpose(2, 3)
    elif bad == "int32-rows":
        rows = rows.int()
    else:
        rows = rows[:1]
    with pytest.raises(ValueError, match="state_rows"):
        ops.ssd_chunk_scan_ref(x, dt, A, B, C, 4, **kw, state_rows=(states, rows))


def test_conv1d_update_continues_prefill():
    b, d, l, w = 2, 6, 9, 4
    r = gen(1)
    x, weight, bias = torch.randn(b, d, l, generator=r), torch.randn(d, w, generator=r), torch.randn(d, generator=r)
    full = ops.causal_conv1d_ref(x, weight, bias, activation="silu")
    out, state = ops.causal_conv1d_ref(x[..., :5], weight, bias, return_final_states=True, activation="silu")
    cache = torch.zeros(3, d, w - 1)
    cache[[2, 0]] = state
    steps = [ops.causal_conv1d_update_ref(x[..., t], cache, weight, bias, "silu", torch.tensor([2, 0]))
             for t in range(5, l)]
    torch.testing.assert_close(torch.cat([out, torch.stack(steps, -1)], -1), full)
    # the matching nn.Conv1d with left padding is the independent check
    ref = F.silu(F.conv1d(F.pad(x, (w - 1, 0)), weight.unsqueeze(1), bias, groups=d))
    torch.testing.assert_close(full, ref)


@pytest.mark.parametrize("grouped", [False, True])
def test_selective_scan_equals_state_update_loop(grouped):
    b, d, l, n = 2, 8, 11, 4
    r = gen(2)
    u, delta, z = (torch.randn(b, d, l, generator=r) for _ in range(3))
    A = -torch.rand(d, n, generator=r)
    shape = (b, 2, n, l) if grouped else (b, n, l)
    B, C = torch.randn(*shape, generator=r), torch.randn(*shape, generator=r)
    D, bias = torch.randn(d, generator=r), torch.randn(d, generator=r)
    y, last = ops.selective_scan_ref(u, delta, A, B, C, D, z, bias, True, return_last_state=True)
    state = torch.zeros(b, d, n)
    ys = []
    for t in range(l):
        Bt = B[..., t].repeat_interleave(d // 2, 1) if grouped else B[..., t]
        Ct = C[..., t].repeat_interleave(d // 2, 1) if grouped else C[..., t]
        if grouped:  # per-channel B, C through the multi-head layout: h = d, p = 1
            s4 = state.unsqueeze(2)
            ys.append(ops.selective_state_update_ref(
                s4, u[..., t, None], delta[..., t, None], A[:, None], Bt, Ct, D[:, None], z[..., t, None],
                bias[:, None], True)[..., 0])
            state = s4.squeeze(2)
        else:
            ys.append(ops.selective_state_update_ref(state, u[..., t], delta[..., t], A, Bt, Ct, D, z[..., t], bias, True))
    torch.testing.assert_close(y, torch.stack(ys, -1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, state, atol=1e-5, rtol=1e-5)


def test_attention_with_cache_equals_full():
    b, l, hq, hkv, e = 2, 10, 4, 2, 8
    r = gen(3)
    q, k, v = torch.randn(b, l, hq, e, generator=r), torch.randn(b, l, hkv, e, generator=r), torch.randn(b, l, hkv, e, generator=r)
    full = ops.attention_ref(q, k, v)
    last = ops.attention_ref(q[:, -3:], k, v)
    torch.testing.assert_close(last, full[:, -3:])
    # padded cache: row 1 holds only 6 valid keys
    part = ops.attention_ref(q[1:, 5:6], k[1:], v[1:], kv_lens=torch.tensor([6]))
    torch.testing.assert_close(part, ops.attention_ref(q[1:, :6], k[1:, :6], v[1:, :6])[:, -1:])
    # against torch's SDPA with repeated kv heads
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                          v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    torch.testing.assert_close(full, sdpa, atol=1e-5, rtol=1e-5)


def test_partial_rotary_preserves_pass_through_and_norm():
    x = torch.randn(1, 5, 2, 8, generator=gen(4))
    cos, sin = ops.rotary_cos_sin(torch.arange(5)[None], rotary_dim=4)
    y = ops.apply_rotary_ref(x, cos, sin)
    torch.testing.assert_close(y[..., 4:], x[..., 4:])
    torch.testing.assert_close(y[..., :4].norm(dim=-1), x[..., :4].norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated


def test_gated_norm_groups_and_rms_norm_residual():
    x, z, w = torch.randn(3, 8, generator=gen(5)), torch.randn(3, 8, generator=gen(6)), torch.randn(8, generator=gen(7))
    out = ops.rmsnorm_gated_ref(x, w, z, eps=0.0, group_size=4)
    xg = (x * F.silu(z)).view(3, 2, 4)
    ref = (xg / xg.pow(2).mean(-1, keepdim=True).sqrt()).view(3, 8) * w
    torch.testing.assert_close(out, ref)
    y, res = ops.rms_norm_ref(x, w, eps=0.0, residual=z)
    torch.testing.assert_close(res, x + z)
    torch.testing.assert_close(y, (x + z) / (x + z).pow(2).mean(-1, keepdim=True).sqrt() * w)


def test_pdl_launch_keywords_only_for_cuda_when_enabled(monkeypatch):
    """PDL keywords go only to CUDA launches and only when enabled: CPU / interpreter launches never get them."""
    pytest.importorskip("triton")
    from ssmq.kernels import _common, policy

    for on in (True, False):
        with policy.using(policy.KernelPolicy(pdl=on)):
            assert _common.pdl_args(torch.zeros(1)) == {}


def test_host_launch_arithmetic_equals_tritons():
    """``cdiv`` and ``next_pow2`` (plain Python, what launch plans call) give what triton.cdiv and
    triton.next_power_of_2 give, over every value a plan meets and the edges."""
    triton = pytest.importorskip("triton")
    from ssmq.kernels._common import cdiv, next_pow2, pow2

    values = [*range(0, 4200), 8191, 8192, 8193, 50288, 1 << 20, (1 << 20) + 1]
    assert [next_pow2(n) for n in values] == [triton.next_power_of_2(n) for n in values]
    assert [cdiv(a, b) for a in values[:600] for b in (1, 2, 3, 7, 16, 128, 132)] == \
        [triton.cdiv(a, b) for a in values[:600] for b in (1, 2, 3, 7, 16, 128, 132)]
    assert pow2(0) == 1 and pow2(5, 16) == 16 and pow2(17, 16) == 32


@pytest.mark.parametrize("kernel, reference", [("quant_linear", "quant_linear_ref"),
                                               ("quantize_act", "quantize_act_ref"),
                                               ("quant_linear_act", "quant_linear_act_ref")])
def test_quantized_linear_kernels_take_their_references_arguments(kernel, reference):
    # a model calls kernels.X positionally; swapping in its reference (the reference path of the GPU tests) must
    # accept the same call
    assert list(inspect.signature(getattr(dispatch, kernel)).parameters) == \
        list(inspect.signature(getattr(ops, reference)).parameters)
