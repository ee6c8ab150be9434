"""SSDi8 references: the float stage decomposition equals ssd_chunk_scan_ref bit for bit; every int8 stage is
within its rounding bound of its float twin; the whole int8 scan within a stated bound of the float SSD."""

import math

import pytest
import torch

from ssmq.ops.quant_ssm import dequantize_ref, quantize_ref
from ssmq.ops.ssd import ssd_chunk_scan_ref
from ssmq.ops.ssd_int8 import (SSDi8Options, chunk_bmm_int8, chunk_scan_diag_int8, chunk_scan_off_int8,
                               chunk_state_int8, decay_fixed_point, off_lut, requantize_state, ssd_int8_ranges,
                               ssd_int8_ref, state_lut, state_passing_int8)
from ssmq.ops.ssd_stages import (chunk_bmm, chunk_cumsum, chunk_scan_diag, chunk_scan_off, chunk_state,
                                 chunk_tokens, heads_of_groups, ssd_stages_ref, state_passing)


def problem(b=2, l=70, h=4, p=8, g=2, n=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h) - 1, A=-torch.rand(h, generator=gen) * 2, B=r(b, l, g, n),
                C=r(b, l, g, n), dt_bias=r(h) * 0.5, dt_softplus=True)


def scales(pr, T):
    rng = ssd_int8_ranges(pr["x"], pr["dt"], pr["A"], pr["B"], pr["C"], T, dt_bias=pr["dt_bias"], dt_softplus=True)
    return {k: v / 127 for k, v in rng.items()}


@pytest.mark.parametrize("shape", [(2, 37, 4, 8, 2, 16, 8), (1, 64, 6, 4, 3, 8, 16), (2, 5, 2, 4, 1, 4, 8)])
def test_stages_equal_chunk_scan_ref_exactly(shape):
    b, l, h, p, g, n, T = shape
    pr = problem(b, l, h, p, g, n)
    kw = dict(D=torch.randn(h), z=torch.randn(b, l, h, p), dt_bias=pr["dt_bias"], dt_softplus=True,
              initial_states=torch.randn(b, h, p, n), return_final_states=True, dt_limit=(0.0, 3.0))
    args = (pr["x"], pr["dt"], pr["A"], pr["B"], pr["C"], T)
    y1, f1 = ssd_chunk_scan_ref(*args, **kw)
    y2, f2 = ssd_stages_ref(*args, **kw)
    assert torch.equal(y1, y2) and torch.equal(f1, f2)


@pytest.fixture
def staged():
    """A problem cut into chunks, with its codes (B, C per group; X_scaled per (h, p))."""
    T, h = 16, 4
    pr = problem()
    sc = scales(pr, T)
    dtc, Acs = chunk_cumsum(pr["dt"], pr["A"], T, pr["dt_bias"], True)
    Bc, Cc = chunk_tokens(pr["B"], T), chunk_tokens(pr["C"], T)
    Bq, Cq = quantize_ref(Bc, sc["B"][:, None]), quantize_ref(Cc, sc["C"][:, None])
    xc = chunk_tokens(pr["x"], T)
    return dict(sc=sc, dtc=dtc, Acs=Acs, Bc=Bc, Cc=Cc, Bq=Bq, Cq=Cq, xc=xc, h=h,
                Bd=dequantize_ref(Bq, sc["B"][:, None]), Cd=dequantize_ref(Cq, sc["C"][:, None]))


def test_chunk_state_int8_within_rounding_bound(staged):
    s, h = staged, staged["h"]
    xs = s["xc"] * state_lut(s["dtc"], s["Acs"])[..., None]
    xs_q = quantize_ref(xs, s["sc"]["xs"])
    acc = chunk_state_int8(xs_q, s["Bq"])
    assert acc.dtype == torch.int32
    # the integers are exact: the same sums in float64
    exact = torch.einsum("bcshp,bcshn->bchpn", xs_q.double(), heads_of_groups(s["Bq"].double(), h))
    assert torch.equal(acc.double(), exact)
    sB = s["sc"]["B"].repeat_interleave(h // 2)[:, None, None]
    got = acc.float() * s["sc"]["xs"][..., None] * sB
    want = chunk_state(heads_of_groups(s["Bc"], h), xs, torch.zeros_like(s["Acs"]))  # LUT already in xs
    # |xs_q s_xs · B_q s_B − xs · B| <= |xs|·s_B/2 + |B|·s_xs/2 + s_xs s_B / 4, summed over the chunk's tokens
    Bh = heads_of_groups(s["Bc"].abs(), h)
    bound = (torch.einsum("bcshp,bcshn->bchpn", xs.abs(), torch.ones_like(Bh)) * sB / 2
             + torch.einsum("bcshp,bcshn->bchpn", torch.ones_like(xs), Bh) * s["sc"]["xs"][..., None] / 2
             + xs.shape[2] * s["sc"]["xs"][..., None] * sB / 4)
    err = (got - want).abs()
    assert (err <= bound * 1.001 + 1e-5).all()
    assert err.max() > 0  # quantization really happened


def test_requantize_state_half_a_code(staged):
    s, h = staged, staged["h"]
    acc = torch.randint(-2000, 2000, (2, 3, h, 8, 16), dtype=torch.int32)
    in_scale, st = torch.rand(h, 8) * 1e-3, torch.full((h, 8), 2000 / 127) * 1e-3 * 1.01
    q = requantize_state(acc, in_scale / st)
    value = acc.float() * in_scale[..., None]
    assert q.dtype == torch.int8
    assert ((dequantize_ref(q, st[..., None]) - value).abs() <= st[..., None] * (0.5 + 1e-5)).all()


def test_state_passing_int8_within_one_code_per_chunk():
    torch.manual_seed(1)
    b, nc, h, p, n = 2, 12, 3, 4, 8
    chunk_q = torch.randint(-40, 41, (b, nc, h, p, n), dtype=torch.int8)
    Acs = -torch.rand(b, nc, 4, h).cumsum(2) * 0.3  # chunk decays in (0.2, 1]
    init = torch.randint(-40, 41, (b, h, p, n), dtype=torch.int8)
    entering, final = state_passing_int8(chunk_q, decay_fixed_point(Acs), init)
    f_entering, f_final = state_passing(chunk_q.float(), Acs, init.float())
    # one step: |shift rounding| <= 1/2 and |decay_q / 2^7 - decay|·|s| <= 128 / 256: one code, decayed after
    bound = torch.arange(nc).float()[None, :, None, None, None]
    assert ((entering.float() - f_entering).abs() <= bound + 1e-4).all()
    assert ((final.float() - f_final).abs() <= nc + 1e-4).all()
    assert (entering.float() != f_entering).any()
    dq = decay_fixed_point(Acs)
    assert dq.dtype == torch.int32 and dq.min() >= 0 and dq.max() <= 128


def test_chunk_bmm_int8_exact_and_bounded(staged):
    s = staged
    cb = chunk_bmm_int8(s["Cq"], s["Bq"])
    assert cb.dtype == torch.int32
    assert torch.equal(cb.double(), torch.einsum("bctgn,bcsgn->bctsg", s["Cq"].double(), s["Bq"].double()))
    sC, sB = s["sc"]["C"], s["sc"]["B"]
    got = cb.float() * sC * sB
    want = chunk_bmm(s["Cc"], s["Bc"])
    n = s["Bc"].shape[-1]
    bound = (torch.einsum("bctgn,bcsgn->bctsg", s["Cc"].abs(), torch.ones_like(s["Bc"])) * sB / 2
             + torch.einsum("bctgn,bcsgn->bctsg", torch.ones_like(s["Cc"]), s["Bc"].abs()) * sC / 2 + n * sC * sB / 4)
    assert ((got - want).abs() <= bound * 1.001 + 1e-5).all()


def test_chunk_scans_int8_equal_float_on_dequantized_codes(staged):
    s, h = staged, staged["h"]
    st = torch.rand(h, 8) * 0.05 + 0.01
    entering_q = torch.randint(-128, 128, (2, s["Acs"].shape[1], h, 8, 16), dtype=torch.int8)
    y = chunk_scan_off_int8(s["Cq"], entering_q, off_lut(s["Acs"], s["sc"]["C"]), st)
    want = chunk_scan_off(heads_of_groups(s["Cd"], h), dequantize_ref(entering_q, st[..., None]), s["Acs"])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)  # only float32 rounding: the scales are folded
    y = chunk_scan_diag_int8(chunk_bmm_int8(s["Cq"], s["Bq"]), s["xc"], s["dtc"], s["Acs"], s["sc"]["C"], s["sc"]["B"])
    CB = chunk_bmm(heads_of_groups(s["Cd"], h), heads_of_groups(s["Bd"], h))
    torch.testing.assert_close(y, chunk_scan_diag(CB, s["xc"] * s["dtc"][..., None], s["Acs"]), rtol=1e-5, atol=1e-5)


OPTIONS = [SSDi8Options(), SSDi8Options(reformulate=False), SSDi8Options(int8_passing=False),
           SSDi8Options(int8_state=False, int8_passing=False)]


@pytest.mark.parametrize("opts", OPTIONS, ids=["ssdi8", "no-reformulation", "float-passing", "float-state"])
def test_whole_int8_ssd_within_bound_of_float(opts):
    """Stated bound: relative L2 error <= 3% of y and <= 8% of the final state (150 tokens, 10 chunks), Gaussian
    inputs, absmax scales (measured at most 1.9% and 4.5% over the four variants)."""
    T = 16
    pr = problem(l=150)
    sc = scales(pr, T)
    D = torch.randn(4)
    y_f, f_f = ssd_chunk_scan_ref(pr["x"], pr["dt"], pr["A"], pr["B"], pr["C"], T, D=D, dt_bias=pr["dt_bias"],
                                  dt_softplus=True, return_final_states=True)
    Bq, Cq = quantize_ref(pr["B"], sc["B"][:, None]), quantize_ref(pr["C"], sc["C"][:, None])
    y, f = ssd_int8_ref(pr["x"], pr["dt"], pr["A"], Bq, sc["B"], Cq, sc["C"], sc["xs"], sc["state"], T, D=D,
                        dt_bias=pr["dt_bias"], dt_softplus=True, return_final_states=True, x_scale=sc["x"],
                        options=opts)
    if opts.int8_state:
        assert f.dtype == torch.int8
        f = dequantize_ref(f, sc["state"][..., None])
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert 1e-4 < rel(y, y_f) <= 0.03
    assert rel(f, f_f) <= 0.08


def test_prefill_split_at_a_chunk_boundary_carries_the_int8_state_exactly():
    T = 16
    pr = problem(l=64)
    sc = scales(pr, T)
    Bq, Cq = quantize_ref(pr["B"], sc["B"][:, None]), quantize_ref(pr["C"], sc["C"][:, None])
    kw = dict(dt_bias=pr["dt_bias"], dt_softplus=True, return_final_states=True)
    args = lambda sl, **k: (pr["x"][:, sl], pr["dt"][:, sl], pr["A"], Bq[:, sl], sc["B"], Cq[:, sl], sc["C"],  # noqa: E731
                            sc["xs"], sc["state"], T)
    y, f = ssd_int8_ref(*args(slice(None)), **kw)
    y1, f1 = ssd_int8_ref(*args(slice(0, 32)), **kw)
    y2, f2 = ssd_int8_ref(*args(slice(32, 64)), initial_states=f1, **kw)
    assert torch.equal(f2, f)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-6)


def test_int_einsum_gives_the_int32_integers():
    from ssmq.ops.ssd_int8 import int_einsum

    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-128, 128, (3, 256, 16), dtype=torch.int8, generator=gen)
    b = torch.randint(-128, 128, (3, 256, 8), dtype=torch.int8, generator=gen)
    a[0] = -128
    b[0] = -128  # the largest sums: 256 · 2^14
    got = int_einsum("xkm,xkn->xmn", a, b)
    assert got.dtype == torch.int32
    assert torch.equal(got, torch.einsum("xkm,xkn->xmn", a.to(torch.int32), b.to(torch.int32)))
    assert got[0, 0, 0].item() == 256 * 128 * 128


def test_int8_passing_needs_int8_state():
    pr = problem(l=16)
    sc = scales(pr, 16)
    with pytest.raises(ValueError, match="needs the int8 state"):
        ssd_int8_ref(pr["x"], pr["dt"], pr["A"], pr["B"].to(torch.int8), sc["B"], pr["C"].to(torch.int8),
                     sc["C"], sc["xs"], sc["state"], 16, options=SSDi8Options(int8_state=False))
    assert math.isfinite(sc["state"].sum().item())
