"""The int8-input scans equal their references (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU): the SSD
(``ssmq.kernels.ssd.quant_ssd_chunk_scan``) ``quant_ssd_ref`` and the Mamba-1 selective scan
(``ssmq.kernels.scan.quant_selective_scan``) ``quant_selective_scan_ref``. Float32 out within 1e-5 relative (the
kernels dequantize at load, the references fold scales later: only float32 rounding differs; ~1e-7 measured in
the interpreter), fp16 out within the float kernels' fp16 tolerance."""

import pytest
import torch

from test_kernels import DEV, INTERPRET, check, kernel_module, rnd

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def k():
    return kernel_module("ssd")


@pytest.fixture(scope="module")
def ks():
    return kernel_module("scan")


# (b, l, h, p, g, n, T, k state groups): one chunk, several (with a partial last one), ngroups 1 and 2,
# per-tensor (k 1), per-state-group and per-state (k n) B/C scales
SHAPES = [(1, 16, 2, 16, 1, 16, 16, 1), (2, 37, 4, 16, 2, 16, 16, 4), (1, 50, 2, 20, 1, 32, 16, 32),
          (1, 9, 4, 16, 2, 16, 8, 2)] if INTERPRET else \
    [(2, 1000, 8, 64, 1, 128, 256, 4), (1, 333, 6, 32, 2, 64, 64, 64), (2, 2048, 80, 64, 1, 128, 256, 8)]


def codes(*shape, gen):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen).to(DEV)


def case(b, l, h, p, g, n, kk, seed, per_tensor_x=False):
    gen = torch.Generator().manual_seed(seed)
    x_q, B_q, C_q = codes(b, l, h, p, gen=gen), codes(b, l, g, n, gen=gen), codes(b, l, g, n, gen=gen)
    s_x = torch.tensor(0.01, device=DEV) if per_tensor_x else (torch.rand(h, p, generator=gen) * 0.02 + 1e-3).to(DEV)
    s_B, s_C = [(torch.rand(g, kk, generator=gen) * 0.02 + 1e-3).to(DEV) for _ in range(2)]
    return x_q, s_x, rnd(b, l, h), -torch.rand(h, device=DEV) - 0.5, B_q, s_B, C_q, s_C


@pytest.mark.parametrize("states", ["fused", "split"])
@pytest.mark.parametrize("b,l,h,p,g,n,T,kk", SHAPES)
def test_quant_ssd_kernel_matches_reference(k, monkeypatch, states, b, l, h, p, g, n, T, kk):
    from ssmq.ops.quant_ssm import quant_ssd_ref

    monkeypatch.setitem(k.CFG, "STATES", states)
    torch.manual_seed(1)
    args = case(b, l, h, p, g, n, kk, seed=l, per_tensor_x=kk == 1)
    kw = dict(D=rnd(h), dt_bias=rnd(h) - 2, dt_softplus=True, initial_states=rnd(b, h, p, n), return_final_states=True)
    ref = quant_ssd_ref(*(a.cpu() for a in args), T, **{a: v.cpu() if torch.is_tensor(v) else v for a, v in kw.items()})
    got = k.quant_ssd_chunk_scan(*args, T, **kw)
    check(got, tuple(r.to(DEV) for r in ref), 1e-5)
    # fp16 out: the model's path (y and the tensor-core operands in fp16), as the float SSD's fp16 tolerance
    y16 = k.quant_ssd_chunk_scan(*args, T, **kw, out_dtype=torch.float16)
    check(y16, (ref[0].to(DEV, torch.float16), ref[1].to(DEV)), 3e-3)


def test_quant_ssd_kernel_plain_and_dt_limit(k):
    """No D, no initial state, dt_limit: the remaining launch flags."""
    from ssmq.ops.quant_ssm import quant_ssd_ref

    b, l, h, p, g, n, T, kk = (1, 21, 2, 16, 1, 16, 8, 2) if INTERPRET else (2, 700, 8, 64, 1, 128, 256, 2)
    args = case(b, l, h, p, g, n, kk, seed=3)
    kw = dict(dt_limit=(0.01, 0.3))
    ref = quant_ssd_ref(*(a.cpu() for a in args), T, **kw)
    check(k.quant_ssd_chunk_scan(*args, T, **kw), ref.to(DEV), 1e-5)


# Mamba-1 (b, d, l, n, nseg): one program's channels and more, several 4-step blocks with a partial last one,
# time segments (the SEG_STATE pass) forced
SCAN_SHAPES = [(1, 16, 9, 16, 1), (2, 40, 37, 16, 3)] if INTERPRET else [(2, 1536, 1000, 16, 0), (1, 5120, 2048, 16, 0)]


@pytest.mark.parametrize("b,d,l,n,nseg", SCAN_SHAPES)
@pytest.mark.parametrize("scales", ["per-channel", "per-tensor", "float-dt-z"])
def test_quant_selective_scan_kernel_matches_reference(ks, monkeypatch, b, d, l, n, nseg, scales):
    from ssmq.ops.quant_ssm import quant_selective_scan_ref

    if nseg:
        monkeypatch.setitem(ks.CFG, "NSEG", nseg)
    gen = torch.Generator().manual_seed(d + l)
    per_ch = scales != "per-tensor"
    sc = lambda m: (torch.rand(m, 1, generator=gen) * 0.02 + 1e-3).to(DEV) if per_ch else \
        torch.tensor(0.01, device=DEV)  # noqa: E731
    u_q, dt_q, z_q = (codes(b, d, l, gen=gen) for _ in range(3))
    B_q, C_q = codes(b, n, l, gen=gen), codes(b, n, l, gen=gen)
    s_u, s_dt, s_z, s_B, s_C = sc(d), sc(d), sc(d), sc(n), sc(n)
    if scales == "float-dt-z":  # Δ and z from 16-bit taps: floats, no scale
        dt_q, s_dt, z_q, s_z = rnd(b, d, l) * 0.5, None, rnd(b, d, l), None
    A = -torch.rand(d, n, generator=gen).to(DEV) - 0.2
    args = (u_q, s_u, dt_q, s_dt, A, B_q, s_B, C_q, s_C, rnd(d), z_q, s_z, rnd(d) - 1, True, rnd(b, d, n), True)
    cpu = lambda t: t.cpu() if torch.is_tensor(t) else t  # noqa: E731
    ref = quant_selective_scan_ref(*(cpu(a) for a in args))
    check(ks.quant_selective_scan(*args), tuple(r.to(DEV) for r in ref), 1e-5)
    y16 = ks.quant_selective_scan(*args, out_dtype=torch.float16)
    check(y16, (ref[0].to(DEV, torch.float16), ref[1].to(DEV)), 3e-3)
