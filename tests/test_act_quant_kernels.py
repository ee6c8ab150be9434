"""The producers of an A8 linear's input with int8 codes out (block norm, gated norm, online Hadamard) equal their
references in ``ssmq.ops``: the codes are exactly ``quantize_act_ref`` of the kernel's own float output (IEEE
division, round half to even, the per-token scale max|out| / 127), and that float output is the unfused kernel's.

``gpu`` tests (skipped without CUDA); ``SSMQ_TRITON_INTERPRET=1`` runs a smaller sweep through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from ssmq import ops
from ssmq.ops.hadamard import hadamard_quant_ref, hadamard_transform
from ssmq.ops.quant_linear import fake_quantize_ref, quantize_act_ref
from test_kernels import DEV, DTYPES, INTERPRET, TOL, cases, kernel_module, rel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def N():
    return kernel_module("norm")


@pytest.fixture(scope="module")
def H():
    return kernel_module("ssmq.kernels.hadamard")


def _scale(static):
    return torch.tensor(0.013, device=DEV) if static else None


def _same_codes(q, s, out, static, scale):
    """q, s are quantize_act_ref(out) exactly (the float output the kernel quantized)."""
    q_ref, s_ref = quantize_act_ref(out, scale)
    assert q.dtype == torch.int8 and q.shape == out.shape
    assert torch.equal(s, s_ref), (s, s_ref)
    assert torch.equal(q, q_ref), f"{(q != q_ref).sum().item()} codes differ"
    if static:
        assert s.dim() == 0
    else:
        assert s.shape == out.shape[:-1]


def _close_codes(q, q_ref):
    """Codes of two float outputs that agree to rounding: at most one step apart, and rarely."""
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape,has_res,res32", cases(
    [((1, 2560), True, True), ((3, 5, 768), True, False), ((128, 2560), False, True), ((7, 100), True, True)],
    [((1, 48), True, True), ((3, 2, 40), False, True), ((5, 64), True, False)]))
def test_rms_norm_quant(N, dtype, static, shape, has_res, res32):
    torch.manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape, device=DEV).to(dtype)
    res = (torch.randn(shape, device=DEV) * 2).to(torch.float32 if res32 else dtype) if has_res else None
    w = (1 + 0.3 * torch.randn(d, device=DEV)).to(dtype)
    if not static:
        x[0].zero_()  # an all-zero row (when there is no residual): the scale is EPS, the codes 0
    scale = _scale(static)
    q, s, new_res = N.rms_norm_quant(x, w, 1e-5, res, res32, scale)
    out, res_float = N.rms_norm(x, w, 1e-5, res, res32)
    assert torch.equal(new_res, res_float)
    if dtype == torch.float32:  # no rounding to hide the last-bit differences of two compiled kernels (rsqrt, FMAs)
        _close_codes(q, quantize_act_ref(out, scale)[0])
    else:
        _same_codes(q, s, out, static, scale)
    q_ref, s_ref, r_ref = ops.rms_norm_quant_ref(x.cpu(), w.cpu(), 1e-5, None if res is None else res.cpu(), res32,
                                                 None if scale is None else scale.cpu())
    assert rel(new_res, r_ref) < 1e-6
    _close_codes(q.cpu(), q_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("shape,group", cases(
    # below the SM count, a dynamic scale over several groups runs the float norm + the quantize kernel; from it on
    # (200 rows), one program a row
    [((1, 5120), None), ((4, 5120), 1280), ((2, 3, 640), 160), ((128, 2048), 256), ((200, 1024), 256), ((3, 96), 48)],
    [((1, 64), None), ((3, 64), 16), ((2, 2, 48), 24)]))
def test_rmsnorm_gated_quant(N, dtype, static, with_z, shape, group):
    torch.manual_seed(1)
    d = shape[-1]
    x = torch.randn(shape, device=DEV).to(dtype)
    z = torch.randn(shape, device=DEV).to(dtype) if with_z else None
    w = (1 + 0.3 * torch.randn(d, device=DEV)).to(dtype)
    scale = _scale(static)
    q, s, out = N.rmsnorm_gated_quant(x, w, z, 1e-6, group, False, scale, True, True)
    float_out = N.rmsnorm_gated(x, w, z, 1e-6, group, False)  # the same arithmetic as the float kernel: in float32
    assert torch.equal(out, float_out) if dtype != torch.float32 else rel(out, float_out) < 1e-6  # up to last bits
    _same_codes(q, s, out, static, scale)
    q2, s2, none = N.rmsnorm_gated_quant(x, w, z, 1e-6, group, False, scale)  # codes only
    assert none is None and torch.equal(q2, q) and torch.equal(s2, s)
    ref_out = ops.rmsnorm_gated_ref(x.cpu(), w.cpu(), None if z is None else z.cpu(), 1e-6, group)
    assert rel(out, ref_out) < TOL[dtype]
    _close_codes(q.cpu(), quantize_act_ref(ref_out, None if scale is None else scale.cpu())[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape,group", cases([((1, 5120), None), ((64, 5120), None), ((3, 2, 2560), None),
                                               ((2, 4096), 1024), ((5, 40), None)],
                                              [((1, 64), None), ((3, 40), None), ((2, 64), 32)]))
@pytest.mark.parametrize("kernel_rows", ["shipped", "all"])
def test_rmsnorm_gated_hadamard_quant(H, monkeypatch, dtype, static, shape, group, kernel_rows):
    """Quamba2's out_proj input: gated norm, online Hadamard and codes in one kernel (one norm group, a static scale,
    up to max_rows rows; ``all``: at every row count), or the gated norm kernel then hadamard_quant."""
    if kernel_rows == "all":
        monkeypatch.setitem(H.CFG, "max_rows", 1 << 30)
    torch.manual_seed(4)
    d = shape[-1]
    x, z = torch.randn(shape, device=DEV).to(dtype), torch.randn(shape, device=DEV).to(dtype)
    w = (1 + 0.3 * torch.randn(d, device=DEV)).to(dtype)
    scale = _scale(static)
    q, s, y = H.rmsnorm_gated_hadamard_quant(x, w, z, 1e-6, group, False, scale, True, True)
    assert y.dtype == dtype
    _same_codes(q, s, y, static, scale)
    q2, s2, none = H.rmsnorm_gated_hadamard_quant(x, w, z, 1e-6, group, False, scale)
    assert none is None and torch.equal(q2, q) and torch.equal(s2, s)
    exact = hadamard_transform(ops.rmsnorm_gated_ref(x.double().cpu(), w.double().cpu(), z.double().cpu(), 1e-6,
                                                     group))
    assert rel(y, exact) < (8e-3 if dtype != torch.float32 else 1e-5)
    q_ref, _, _ = ops.rmsnorm_gated_quant_ref(x.cpu(), w.cpu(), z.cpu(), 1e-6, group, False,
                                              None if scale is None else scale.cpu(), rotate=True)
    diff = (q.cpu().int() - q_ref.int()).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.05


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape", cases([(1, 5120), (32, 5120), (3, 2, 2560), (4, 8192), (2, 768), (5, 64), (1, 40)],
                                        [(1, 64), (3, 40), (2, 2, 96)]))
@pytest.mark.parametrize("kernel_rows", ["shipped", "all"])
def test_hadamard_quant(H, monkeypatch, dtype, static, shape, kernel_rows):
    if kernel_rows == "all":
        monkeypatch.setitem(H.CFG, "max_rows", 1 << 30)
    torch.manual_seed(2)
    x = torch.randn(shape, device=DEV).to(dtype)
    scale = _scale(static)
    q, s, y = H.hadamard_quant(x, scale, True, with_y=True)
    assert y.dtype == dtype
    _same_codes(q, s, y, static, scale)
    q2, s2 = H.hadamard_quant(x, scale)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    exact = hadamard_transform(x.double().cpu())
    assert rel(y, exact) < (5e-3 if dtype != torch.float32 else 1e-5)
    if not INTERPRET:  # the unfused CUDA path (two GEMMs, then quantize): the same up to summation order
        q_ref, _ = hadamard_quant_ref(x, scale)
        _close_codes(q, q_ref)



@pytest.mark.parametrize("rows,static,fused", [(1, True, True), (16, True, True), (17, True, False), (1, False, False)])
def test_hadamard_kernel_serves_decode_rows_with_a_static_scale(H, monkeypatch, rows, static, fused):
    """The one-kernel form runs for a static scale up to configs/hadamard.json's max_rows (16 shipped); more rows and
    dynamic scales run the Hadamard GEMMs, then the quantize kernel."""
    monkeypatch.setitem(H.CFG, "max_rows", 16)
    calls = []
    real = H._launch
    monkeypatch.setattr(H, "_launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, z = (torch.randn(rows, 40, device=DEV, dtype=torch.float16) for _ in range(2))
    H.rmsnorm_gated_hadamard_quant(x, torch.ones(40, device=DEV, dtype=torch.float16), z, 1e-6, None, False,
                                   _scale(static))
    assert len(calls) == int(fused)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's fp32 -> e4m3 conversion does not round to nearest even")
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape,group", cases([((1, 2560), None), ((5, 5120), 1280), ((2, 3, 768), None)],
                                              [((1, 64), None), ((3, 64), 16)]))
def test_norms_emit_fp8_codes(N, static, shape, group):
    # e4m3 codes (fp8-w8a8's in_proj / out_proj inputs) from both norms' epilogues: quantize_act_ref's codes of the
    # float output, byte for byte (scale max|out| / 448 or the static one; the IEEE quotient clamped to +-448, RNE)
    torch.manual_seed(2)
    d = shape[-1]
    x, z, res = (torch.randn(shape, device=DEV).half() for _ in range(3))
    w = (1 + 0.3 * torch.randn(d, device=DEV)).half()
    scale = _scale(static)
    f8 = torch.float8_e4m3fn
    q, s, _ = N.rms_norm_quant(x, w, 1e-5, res, True, scale, True, f8)
    out, _ = N.rms_norm(x, w, 1e-5, res, True)
    q_ref, s_ref = quantize_act_ref(out, scale, True, f8)
    assert q.dtype == f8 and torch.equal(s, s_ref) and torch.equal(q.view(torch.int8), q_ref.view(torch.int8))
    q, s, out = N.rmsnorm_gated_quant(x, w, z, 1e-6, group, False, scale, True, True, None, f8)
    q_ref, s_ref = quantize_act_ref(out, scale, True, f8)
    assert q.dtype == f8 and torch.equal(s, s_ref) and torch.equal(q.view(torch.int8), q_ref.view(torch.int8))


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="whole models on CUDA")
@pytest.mark.parametrize("arch,recipe", [("mamba2", "static-w8a8"), ("mamba2", "dynamic-w8a8"),
                                         ("mamba2", "quamba2-w8a8"), ("mamba1", "quamba-w8a8"), ("mamba2", "fp8-w8a8"),
                                         ("mamba1", "fp8-w8a8")])
def test_fused_models_on_gpu(monkeypatch, arch, recipe):
    """fp16 tiny models on the GPU: the fusion changes no logit where only norms quantize (the same arithmetic as the
    float norm kernel + the quantize kernel), stays within fp16 rounding where the online Hadamard is fused (tensor
    -core dots instead of cuBLAS), and CUDA-graph decode (captured with the fusion) equals eager decode."""
    from ssmq.kernels import policy
    from ssmq.quant.api import quantize
    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from tiny_ssm import synthetic_calibration, tiny_model

    model = tiny_model(arch).half().cuda()
    model = quantize(model, recipe, synthetic_calibration(model.config.vocab_size, n=4, seqlen=16), progress=False)
    ids = torch.randint(0, model.config.vocab_size, (3, 20), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    outs = {}
    with torch.inference_mode():
        for fused in (False, True):
            monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(act_quant_fusion=fused)])
            cache = model.allocate_cache(3, 32)
            prefill = model(ids, cache)
            steps = [model.step(ids[:, i], cache).float() for i in range(4)]
            outs[fused] = (prefill.float(), torch.stack(steps))
        exact = "w8a8" in recipe and "quamba" not in recipe
        for a, b in zip(outs[False], outs[True]):
            if exact:
                assert torch.equal(a, b)
            else:
                assert rel(b, a) < 2e-2
        dec = CudaGraphDecoder(model, max_batch=3, max_seqlen=32)
        eager_cache = model.allocate_cache(3, 32)
        slots = torch.arange(3, device="cuda")
        for i in range(4):
            eager = model.step(ids[:, i], eager_cache, slots).float()
            graph = dec(ids[:, i], slots).float()
            # the same kernels in the same order: replays equal eager steps (H100, 2026-11-26: bit for bit)
            torch.testing.assert_close(graph, eager, atol=1e-3, rtol=1e-3)


def _gated_z_case(shape, per_channel, seed):
    """float16 y, z (shape), norm weight (d,) and act_z's scale (d,) or () for the gated norm with z fake-quantized."""
    torch.manual_seed(seed)
    d = shape[-1]
    x, z = torch.randn(shape, device=DEV).half(), torch.randn(shape, device=DEV).half()
    w = (1 + 0.3 * torch.randn(d, device=DEV)).half()
    zs = (torch.rand(d, device=DEV) * 0.02 + 0.01) if per_channel else torch.tensor(0.02, device=DEV)
    return x, z, w, zs


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("shape,group", cases([((2, 5120), None), ((3, 1024), 256)], [((2, 64), None), ((3, 64), 16)]))
def test_gated_norm_with_z_fake_quant(N, per_channel, shape, group):
    """The float gated norm with act_z's fake-quantization in registers (a rotated out_proj's input: no codes) equals
    the fake-quant kernel's output fed to the same norm kernel, bit for bit, and the reference."""
    x, z, w, zs = _gated_z_case(shape, per_channel, seed=6)
    got = N.rmsnorm_gated(x, w, z, 1e-6, group, False, zs)
    assert torch.equal(got, N.rmsnorm_gated(x, w, kernel_module("fake_quant").fake_quantize(z, zs), 1e-6, group))
    ref = ops.rmsnorm_gated_ref(x.cpu(), w.cpu(), z.cpu(), 1e-6, group, False, zs.cpu())
    assert rel(got.cpu(), ref) < 8e-3


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("d", cases([5120, 1024], [64]))
def test_z_fake_quant_at_rounding_ties(N, H, rotate, d):
    """z's fake-quant inside the gated norm rounds every quotient as the reference's IEEE division does: row 0's
    scales put z / scale within an ulp of a half-integer (there a multiply by the scale's reciprocal rounds a tenth of
    the codes the other way), the other rows sit at and one or two float16 steps beside half-integer multiples, and
    +-inf (codes 127 / -128)."""
    g = torch.Generator().manual_seed(11)
    rows = 8
    z0 = (torch.randn(d, generator=g) * 2).half()
    zs = (z0.float() / (torch.randint(-120, 120, (d,), generator=g).float() + 0.5)).abs()
    zs = torch.where(zs > 1e-4, zs, torch.full_like(zs, 0.01))
    k = torch.randint(-130, 130, (rows, d), generator=g).float() + 0.5
    z = (k * zs).half()
    step = torch.randint(-2, 3, (rows, d), generator=g).to(torch.int16) * (torch.rand(rows, d, generator=g) < 0.5)
    z = (z.view(torch.int16) + step.to(torch.int16)).view(torch.float16)
    z = torch.where(z.isfinite(), z, torch.zeros_like(z))
    z[0] = z0
    z[1, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0]).half()
    x, w = torch.randn(rows, d, generator=g).half(), (1 + 0.3 * torch.randn(d, generator=g)).half()
    fq = fake_quantize_ref(z, zs)
    x, z, w, zs, fq = (t.to(DEV) for t in (x, z, w, zs, fq))
    scale = _scale(True)
    if rotate:
        got = H.rmsnorm_gated_hadamard_quant(x, w, z, 1e-6, None, False, scale, True, True, zs)
        want = H.rmsnorm_gated_hadamard_quant(x, w, fq, 1e-6, None, False, scale, True, True)
    else:
        got = (N.rmsnorm_gated(x, w, z, 1e-6, None, False, zs),)
        want = (N.rmsnorm_gated(x, w, fq, 1e-6, None, False),)
    for a, b in zip(got, want):
        assert torch.equal(a, b), f"{(a != b).sum().item()} values differ"


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("shape,group", cases([((2, 5120), None), ((3, 1024), 256)], [((2, 64), None), ((3, 64), 16)]))
def test_gated_quant_with_z_fake_quant(N, H, rotate, per_channel, static, shape, group):
    """Quamba2's act_z quantizer inside the gated norm: z fake-quantized in registers equals the fake-quant kernel's
    output fed to the same norm kernel, bit for bit."""
    x, z, w, zs = _gated_z_case(shape, per_channel, seed=5)
    scale = _scale(static)
    fq = kernel_module("fake_quant").fake_quantize(z, zs)
    if rotate:
        got = H.rmsnorm_gated_hadamard_quant(x, w, z, 1e-6, group, False, scale, True, True, zs)
        want = H.rmsnorm_gated_hadamard_quant(x, w, fq, 1e-6, group, False, scale, True, True)
    else:
        got = N.rmsnorm_gated_quant(x, w, z, 1e-6, group, False, scale, True, True, zs)
        want = N.rmsnorm_gated_quant(x, w, fq, 1e-6, group, False, scale, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ref = ops.rmsnorm_gated_quant_ref(x.cpu(), w.cpu(), z.cpu(), 1e-6, group, False,
                                      None if scale is None else scale.cpu(), True, True, rotate, zs.cpu())
    assert rel(got[2], ref[2]) < 8e-3
