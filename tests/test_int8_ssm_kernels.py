"""The int8 SSM decode kernels (``ssmq.kernels.state_update.quant_state_update``, the conv1d + SiLU + quantize
kernels) equal their references in ``ssmq.ops.quant_ssm`` (GPU, or SSMQ_TRITON_INTERPRET=1 on CPU).

Codes are compared exactly where the arithmetic is the reference's (dequantize = one multiply, IEEE division,
round half to even); the advanced state passes through exp and fused multiply-adds, so a code may sit one step
from the reference's where the float32 state lands within an ulp of a rounding boundary (counted: rare).
"""

from __future__ import annotations

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.ops.quant_ssm import RowScales, quant_state_update_ref, quantize_ref
from test_kernels import DEV, INTERPRET, kernel_module, rel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def SU():
    return kernel_module("state_update")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def codes(*shape, g):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)


def rand(*shape, g):
    return torch.randn(*shape, generator=g)


# (s, b, h, p, groups, n): Mamba-2 (h heads of p, g B/C groups) | Mamba-1 (h = None: d = p channels)
LAYOUTS = {
    "mamba2": (5, 3, 4, 8, 2, 16) if INTERPRET else (64, 33, 24, 64, 2, 128),
    "mamba1": (4, 2, None, 24, 1, 16) if INTERPRET else (48, 17, None, 1536, 1, 16),
}


def _case(layout, state_fmt, input_fmt, seed=0):
    """Arguments of ``quant_state_update_ref`` (CPU) for a layout, a state format (int8 with a cluster index,
    int8 with one group, int8 with dynamic row scales, float) and an input format (codes with per-channel / per-tensor scales, float)."""
    s, b, h, p, g_, n = LAYOUTS[layout]
    g = gen(seed)
    lead = (h, p) if h else (p,)  # a state row is (*lead, n)
    d = p * (h or 1)
    bc = (b, g_, n) if h else (b, n)
    if state_fmt == "float":
        state, table, index = rand(s, *lead, n, g=g), None, None
    elif state_fmt == "int8_rows":
        state, index = codes(s, *lead, n, g=g), None
        table = RowScales(torch.rand(s, *lead, generator=g) * 0.05 + 0.01)
    else:
        state = codes(s, *lead, n, g=g)
        G = 4 if state_fmt == "int8_index" else 1
        table = torch.rand(G, n, generator=g) * 0.05 + 0.01
        index = torch.randint(0, G, (d,), generator=g) if G > 1 else None
    if input_fmt == "float":
        x, xs = rand(b, *lead, g=g), None
        B, Bs, C, Cs = rand(*bc, g=g), None, rand(*bc, g=g), None
    else:
        per_channel = input_fmt == "codes_per_channel"
        x, B, C = codes(b, *lead, g=g), codes(*bc, g=g), codes(*bc, g=g)
        xs = torch.rand(*lead, generator=g) * 0.02 + 0.001 if per_channel else torch.tensor(0.01)
        Bs = torch.rand(*bc[1:], generator=g) * 0.02 + 0.001 if per_channel else torch.tensor(0.02)
        Cs = torch.rand(*bc[1:], generator=g) * 0.02 + 0.001 if per_channel else torch.tensor(0.03)
    if h:  # per-head dt, A, D, dt_bias expanded over p (stride 0: the kernel's one-exp-per-head path)
        dt = rand(b, h, g=g)[:, :, None].expand(b, h, p)
        A = (-torch.rand(h, generator=g))[:, None, None].expand(h, p, n)  # a per-head view, as Mamba-2 passes it
        D = rand(h, g=g)[:, None].expand(h, p)
        dt_bias = rand(h, g=g)[:, None].expand(h, p)
    else:
        dt, A, D, dt_bias = rand(b, d, g=g), -torch.rand(d, n, generator=g), rand(d, g=g), rand(d, g=g)
    z = rand(b, *lead, g=g)
    slots = torch.randperm(s, generator=g)[:b].to(torch.int32)
    return [state, table, index, x, xs, dt, A, B, Bs, C, Cs, D, z, dt_bias, True, slots]


def _clone(args):
    return [a.clone() if torch.is_tensor(a) else RowScales(a.scale.clone()) if isinstance(a, RowScales) else a
            for a in args]


def _to_dev(a):
    """``a`` on DEV, a stride-0 (expanded) view kept so: ``.to`` would materialize it, and the kernels tell Mamba-2's
    per-head A / Δ from per-channel ones by that stride."""
    if isinstance(a, RowScales):
        return RowScales(a.scale.clone().to(DEV))
    if not torch.is_tensor(a) or 0 not in a.stride():
        return a.to(DEV) if torch.is_tensor(a) else a
    base = a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.stride())]
    return base.to(DEV).expand(a.shape)


def _dev(args):
    return [_to_dev(a) for a in args]


def _assert_state_close(got, want, state_fmt):
    got = got.cpu()
    if state_fmt == "float":
        assert rel(got, want) < 1e-6
        return
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1, "a code is more than one step from the reference"
    assert (diff > 0).float().mean() < 1e-3, f"{(diff > 0).float().mean():.2%} of codes differ"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("state_fmt", ["int8_index", "int8_one_group", "int8_rows", "float"])
@pytest.mark.parametrize("input_fmt", ["codes_per_channel", "codes_per_tensor", "float"])
def test_quant_state_update_equals_reference(SU, layout, state_fmt, input_fmt):
    args = _case(layout, state_fmt, input_fmt)
    ref_args = _clone(args)
    y_ref = quant_state_update_ref(*ref_args)
    dev_args = _dev(args)
    before = dev_args[0].clone()
    y = SU.quant_state_update(*dev_args)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert rel(y, y_ref) < 1e-5
    _assert_state_close(dev_args[0], ref_args[0], state_fmt)
    served = args[-1].long().to(DEV)
    others = torch.ones(before.shape[0], dtype=torch.bool, device=DEV)
    others[served] = False
    assert torch.equal(dev_args[0][others], before[others])  # rows not served are not touched
    if state_fmt == "int8_rows":  # the row scales rewritten for the served rows only, as the reference's
        got, want = dev_args[1].scale.cpu(), ref_args[1].scale
        assert rel(got, want) < 1e-5 and torch.equal(got[others.cpu()], args[1].scale[others.cpu()])
        assert not torch.equal(want, args[1].scale)  # (the step did rescale them)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reciprocal_table_path_equals_reference(SU, layout, monkeypatch):
    """The re-quantization by a table of the scales' reciprocals (``CFG["rcp_table"]``, off by default): the same
    codes as the reference but where a value sits within an ulp of a rounding boundary."""
    monkeypatch.setitem(SU.CFG, "rcp_table", True)
    args = _case(layout, "int8_index", "codes_per_channel", seed=3)
    ref_args = [a.clone() if torch.is_tensor(a) else a for a in args]
    y_ref = quant_state_update_ref(*ref_args)
    dev_args = _dev(args)
    assert rel(SU.quant_state_update(*dev_args), y_ref) < 1e-5
    _assert_state_close(dev_args[0], ref_args[0], "int8_index")


def test_y_is_written_in_the_asked_dtype(SU):
    """``out_dtype`` (the model's fp16): the kernel writes y so, no cast after; the same values as the reference's."""
    args = _case("mamba2", "int8_index", "codes_per_channel")
    y_ref = quant_state_update_ref(*[a.clone() if torch.is_tensor(a) else a for a in args], out_dtype=torch.float16)
    y = SU.quant_state_update(*_dev(args), out_dtype=torch.float16)
    assert y.dtype == y_ref.dtype == torch.float16 and rel(y, y_ref) < 1e-3


def test_requantization_rounds_half_to_even(SU):
    """A step whose new state is exactly k / 2 (A = 0, state 0, Δ = 1/2, x·B odd): codes are round-half-even."""
    b, h, p, n = 1, 1, 16, 16
    state = torch.zeros(1, h, p, n, dtype=torch.int8)
    table = torch.ones(1, n)
    x = torch.arange(-8, 8, dtype=torch.int8).reshape(1, 1, p)  # x · B covers odd and even products
    B = torch.tensor([[list(range(-7, 9))]], dtype=torch.int8)
    C = torch.zeros(1, 1, n, dtype=torch.int8)
    one = torch.tensor(1.0)
    dt = torch.full((b, h, p), 0.5)
    A = torch.zeros(h, p, n)
    args = [state, table, None, x, one, dt, A, B, one, C, one, None, None, None, False, None]
    ref_state = state.clone()
    quant_state_update_ref(ref_state, *args[1:])
    assert torch.equal(ref_state[0, 0], torch.round(0.5 * x[0, 0, :, None].float() * B[0, 0, None, :].float()))
    dev_args = _dev(args)
    SU.quant_state_update(*dev_args)
    assert torch.equal(dev_args[0].cpu(), ref_state)


def test_rne_int8_is_torch_round_and_clamp(SU):
    """The codes helper of the kernels: every half-integer tie in and beyond [-128, 127], and random values."""
    import triton

    from _codes_kernel import codes_of

    v = torch.cat([torch.arange(-600, 601) / 2, torch.randn(3000, generator=gen(5)) * 100,
                   torch.tensor([1e9, -1e9, 0.49999997, -0.49999997, 127.5, -128.5])])
    scale = torch.rand(v.numel(), generator=gen(6)) * 2 + 0.01
    out, out2 = torch.empty(v.numel(), dtype=torch.int8), torch.empty(v.numel(), dtype=torch.int8)
    args = _dev([v, scale, out, out2])
    codes_of[(triton.cdiv(v.numel(), 1024),)](*args, v.numel(), BLOCK=1024)
    assert torch.equal(args[2].cpu(), torch.round(v).clamp(-128, 127).to(torch.int8))
    assert torch.equal(args[3].cpu(), quantize_ref(v, scale))


def test_codes_by_bit_assembly_are_exact(SU):
    """The PTX codes helpers of the int8 state (GPU; the interpreter runs their Triton fallback): every int8 code back
    to its float exactly, and codes of v * r = the exact product rounded half to even (in float64, where a product of
    two float32 is exact) then clamped: ties, saturation far outside [-128, 127], infinities."""
    import triton

    from _codes_kernel import codes_of_product

    g = gen(8)
    v = torch.cat([torch.arange(-600, 600) / 2, torch.randn(2800, generator=g) * 100,
                   torch.tensor([1e9, -1e9, 3e7, -3e7, -1.5e7, 0.49999997, -0.49999997, 127.5, -128.5,
                                 float("inf"), float("-inf"), 0.0, -0.0, 126.49999, -127.50001, 2.5, -2.5, 1e-30])])
    r = torch.rand(v.numel(), generator=g) * 4 + 0.01
    r[:1200] = r[4000:] = 1.0  # the ties and the special values as they are
    v, r = torch.cat([v, torch.zeros(4096 - v.numel())]), torch.cat([r, torch.ones(4096 - r.numel())])
    q = torch.arange(4096).remainder(256).sub(128).to(torch.int8)
    out, sat, back = torch.empty(v.numel(), dtype=torch.int8), torch.empty(v.numel(), dtype=torch.int8), torch.empty(
        v.numel())
    args = _dev([v, r, q, out, sat, back])
    codes_of_product[(triton.cdiv(v.numel(), 1024),)](*args, v.numel(), PTX=not INTERPRET, BLOCK=1024)
    want = torch.round(v.double() * r.double()).clamp(-128, 127).to(torch.int8)
    assert torch.equal(args[3].cpu(), want)
    # the saturating conversion rounds the float32 product (one more rounding, as hs * (1 / scale) has)
    assert torch.equal(args[4].cpu(), torch.round(v * r).clamp(-128, 127).to(torch.int8))
    assert torch.equal(args[5].cpu(), q.float())


def test_reciprocal_table_follows_its_scales(SU):
    """The int8 state's reciprocal table (``rcp_table``) is kept per scale tensor and recomputed when the scales change
    in place (a calibration after a decode): never a stale one."""
    scale = torch.rand(4, 16, device=DEV) + 0.5
    first = SU._reciprocal_table(scale, scale)
    assert torch.equal(first, 1.0 / scale) and SU._reciprocal_table(scale, scale) is first
    scale.mul_(2)
    again = SU._reciprocal_table(scale, scale)
    assert again is not first and torch.equal(again, 1.0 / scale)


def test_bad_state_and_scales_are_refused(SU):
    args = _dev(_case("mamba2", "int8_index", "codes_per_channel"))
    with pytest.raises(SSMQError, match="no scale"):
        SU.quant_state_update(*args[:4], None, *args[5:])
    with pytest.raises(SSMQError, match="scale table"):
        SU.quant_state_update(args[0], args[1][:, :-1], *args[2:])
    with pytest.raises(SSMQError, match="need a state_index"):
        SU.quant_state_update(args[0], args[1], None, *args[3:])
    with pytest.raises(SSMQError, match="does not broadcast"):
        SU.quant_state_update(*args[:4], args[4][:, :3], *args[5:])


def test_quantize_codes_match_the_taps():
    """The reference's codes are the taps' (``ActQuantizer.codes``): what the decode kernels are fed."""
    from ssmq.quant.ssm.quantizer import ActQuantizer

    q = ActQuantizer(24, 3, index=torch.arange(24) % 3)
    q.set_range(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.randn(5, 24)
    assert torch.equal(q.codes(x), quantize_ref(x, q.channel_scale()))


# --- conv1d + SiLU + quantize --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def CV():
    return kernel_module("conv1d")


def _assert_codes_close(got, want):
    """int8 codes from a float conv: equal but where the float32 sum order puts a value within an ulp of a rounding
    boundary (then one step apart)."""
    got = got.cpu()
    assert got.dtype == torch.int8 and got.shape == want.shape
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def _conv_scale(kind, d, g, per_channel_shape):
    if kind == "per_tensor":
        return torch.tensor(0.02)
    return (torch.rand(d, generator=g) * 0.02 + 0.005).reshape(per_channel_shape)


CONV_SHAPES = [(2, 40, 7, 4)] if INTERPRET else [(2, 1000, 37, 4), (1, 5376, 300, 4), (3, 64, 1, 3)]


@pytest.mark.parametrize("b,d,l,w", CONV_SHAPES)
@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv1d_silu_quant_equals_reference(CV, b, d, l, w, scale_kind, dtype, with_state):
    # codes, and with fake_quant their values (codes x scale, one float32 product, in x's dtype: the x, B, C taps
    # applied in the conv) with the same final state
    from ssmq.ops.quant_ssm import conv1d_silu_quant_ref

    g = gen(1)
    x, weight, bias = rand(b, d, l, g=g).to(dtype), rand(d, w, g=g).to(dtype), rand(d, g=g).to(dtype)
    init = rand(b, d, w - 1, g=g).to(dtype) if with_state else None
    scale = _conv_scale(scale_kind, d, g, (d, 1))
    want = conv1d_silu_quant_ref(x, weight, bias, scale, init, return_final_states=with_state)
    args = _dev([x, weight, bias, scale, init])
    got = CV.conv1d_silu_quant(*args, return_final_states=with_state)
    values = CV.conv1d_silu_quant(*args, return_final_states=with_state, fake_quant=True)
    if with_state:
        (got, final), (want, want_final), (values, final_v) = got, want, values
        assert torch.equal(final.cpu(), want_final) and torch.equal(final_v, final)
    _assert_codes_close(got, want)
    assert values.dtype == dtype and torch.equal(values, (got.float() * _to_dev(scale).float()).to(dtype))


UPDATE_SHAPES = [(3, 5, 40, 4)] if INTERPRET else [(33, 64, 5376, 4), (1, 2, 1000, 4), (130, 256, 96, 3)]


@pytest.mark.parametrize("b,s,d,w", UPDATE_SHAPES)
@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv1d_update_silu_quant_equals_reference(CV, b, s, d, w, scale_kind, dtype):
    from ssmq.ops.quant_ssm import conv1d_update_silu_quant_ref

    g = gen(2)
    x, weight, bias = rand(b, d, g=g).to(dtype), rand(d, w, g=g).to(dtype), rand(d, g=g).to(dtype)
    state = rand(s, d, w - 1, g=g).to(dtype)
    slots = torch.randperm(s, generator=g)[:b].to(torch.int32)
    scale = _conv_scale(scale_kind, d, g, (d,))
    want_state = state.clone()
    want = conv1d_update_silu_quant_ref(x, want_state, weight, bias, scale, slots)
    args = _dev([x, state, weight, bias, scale, slots])
    got, deq = CV.conv1d_update_silu_quant(*args, dequantized=True)
    assert torch.equal(args[1].cpu(), want_state)  # the shift is a copy: exact
    _assert_codes_close(got, want)
    # the second output: the codes' values in x's dtype, exactly as the reference dequantizes them
    assert deq.dtype == dtype and torch.equal(deq.cpu(), (got.cpu().float() * scale).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_codes_are_the_float_kernels_output_rounded(CV, dtype):
    """Exact: the codes are quantize_ref (IEEE division, round half to even) of the float kernel's own SiLU output
    (the same accumulation), for the prefill and the update kernel, with a per-group (index) scale as the taps have."""
    from ssmq.quant.ssm.quantizer import ActQuantizer

    g = gen(3)
    b, d, l, w = 2, 48, 5, 4
    q = ActQuantizer(d, 4, index=torch.randint(0, 4, (d,), generator=g))
    q.set_range(torch.tensor([0.5, 1.0, 2.0, 4.0]))
    x, weight, bias = _dev([rand(b, d, l, g=g).to(dtype), rand(d, w, g=g).to(dtype), rand(d, g=g).to(dtype)])
    scale = q.channel_scale().to(DEV)
    out = CV.causal_conv1d(x, weight, bias, activation="silu")
    assert torch.equal(CV.conv1d_silu_quant(x, weight, bias, scale[:, None]).cpu(),
                       quantize_ref(out.float(), scale[:, None]).cpu())
    state = torch.zeros(b, d, w - 1, dtype=dtype, device=DEV)
    out1 = CV.causal_conv1d_update(x[..., 0], state.clone(), weight, bias, activation="silu")
    assert torch.equal(CV.conv1d_update_silu_quant(x[..., 0], state, weight, bias, scale).cpu(),
                       quantize_ref(out1.float(), scale).cpu())


def test_conv_scale_shape_is_checked(CV):
    x, state, weight = _dev([torch.randn(2, 8), torch.zeros(2, 8, 3), torch.randn(8, 4)])
    with pytest.raises(SSMQError, match="conv output scale"):
        CV.conv1d_update_silu_quant(x, state, weight, None, torch.ones(4, device=DEV))


# --- fake quantization (the taps' output) -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale_kind", ["per_tensor", "per_channel"])
def test_fake_quantize_is_bit_exact(dtype, scale_kind):
    """One kernel for dequantize(quantize(x)): the reference's values bit for bit, strided inputs included."""
    fake_quantize = kernel_module("fake_quant").fake_quantize
    from ssmq.ops.quant_ssm import fake_quantize_ref

    g = gen(7)
    d = 40 if INTERPRET else 5120
    wide = (rand(3, 5, 2 * d + 7, g=g) * 3).to(dtype)
    x = wide[..., 7:7 + d]  # a slice of a wider projection output, as the taps see it
    scale = _conv_scale(scale_kind, d, g, (d,))
    got = fake_quantize(*_dev([x, scale]))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.cpu(), fake_quantize_ref(x, scale))


@pytest.mark.parametrize("state_fmt", ["int8_index", "int8_rows", "float"])
@pytest.mark.parametrize("input_fmt", ["codes_per_channel", "float"])
@pytest.mark.parametrize("max_tiles", [3, 16])
@pytest.mark.parametrize("prefetch", [True, False])
def test_step_walks_several_tiles(SU, state_fmt, input_fmt, max_tiles, prefetch, monkeypatch):
    """The plain Mamba-2 step with several tiles a program (``STEP_CFG``: few programs an SM): with the next tile
    prefetched (and an int8 state read as int32 words) or not, its B / C once a program (the tiles in one group) or a
    tile (max_tiles 16: tiles of two groups in a program, on the GPU and the interpreter layouts alike; the grid
    then one slot's tiles first), equal to the
    reference, as one tile a program is."""
    for key in SU.STEP_CFG:
        monkeypatch.setitem(SU.STEP_CFG, key, {**SU.STEP_CFG[key], "programs_per_sm": 1e-3, "max_tiles": max_tiles,
                                                "prefetch": prefetch, "words": prefetch,
                                                "tiles_first": max_tiles == 16})
    args = _case("mamba2", state_fmt, input_fmt, seed=5)
    ref_args = _clone(args)
    y_ref = quant_state_update_ref(*ref_args)
    dev_args = _dev(args)
    before = dev_args[0].clone()
    s, b, h, p, g_, n = LAYOUTS["mamba2"]
    fmt = {"int8_index": "int8_table", "int8_rows": "int8_rows", "float": "float"}[state_fmt]
    _, BP, TP, NT = SU._step_grid(b, h, p, n, fmt, dev_args[0].device)
    assert NT > 1 and ((h // g_) * TP % NT == 0) == (max_tiles == 3)  # the cases this test is for
    assert rel(SU.quant_state_update(*dev_args), y_ref) < 1e-5
    _assert_state_close(dev_args[0], ref_args[0], state_fmt)
    others = torch.ones(s, dtype=torch.bool, device=DEV)
    others[args[-1].long().to(DEV)] = False
    assert torch.equal(dev_args[0][others], before[others])
    if state_fmt == "int8_rows":
        assert rel(dev_args[1].scale.cpu(), ref_args[1].scale) < 1e-5
