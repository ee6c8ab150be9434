"""The grouped-GEMM mixture of experts (``kernels.moe``) against its reference (``ops.moe.moe_experts_ref``), and the
reference against the experts as modules.

CPU: the reference equals a loop over per-expert ``GatedMLP`` / squared-ReLU ``MLP`` modules, float and quantized
(``QuantLinear`` experts: int8 and int4 weight-only, fp8 weight-only, FP8 W8A8, run "routed" against the MoE's
"grouped" mode); the kernel's block tables cover every (token, expert) pair once, each block one expert's. ``gpu``
(or ``SSMQ_TRITON_INTERPRET=1``): the Triton kernel equals the reference over shapes, dtypes, weight formats, both
activations, decode-sized and empty inputs, experts without tokens; on CUDA a captured graph of it replays the eager
result for other routings, and a quantized MoE's grouped mode equals its experts run as modules.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ssmq.errors import SSMQError
from ssmq.ops.moe import moe_experts_ref
from ssmq.ops.quant_linear import pack_int4

# weight formats of the experts: (codes, group size or None for per channel, FP8 activations)
QFORMATS = {"int8": ("int8", None, False), "int4-g16": ("int4", 16, False), "fp8": ("fp8", None, False),
            "fp8-w8a8": ("fp8", None, True)}
G32 = {"int4-g32": ("int4", 32, False)}  # 32-column groups: tiles wide enough for every int4 launch setting


def _case(t, d, f, E, k, act, dtype=torch.float32, device="cpu", seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    # distinct experts per token; skew: most tokens to the first experts, some experts get none
    pool = max(k, E // 3) if skew else E
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    w = torch.rand(t, k, generator=g).softmax(-1)
    wu = torch.randn(E, f, d, generator=g) / d ** 0.5
    wd = torch.randn(E, d, f, generator=g) / f ** 0.5
    wg = torch.randn(E, f, d, generator=g) / d ** 0.5 if act == "silu" else None
    to = lambda t_: None if t_ is None else t_.to(device, dtype)  # noqa: E731
    return to(x), w.to(device), idx.to(device), to(wu), to(wd), to(wg)


@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_reference_equals_the_expert_modules(act):
    x, w, idx, wu, wd, wg = _case(23, 32, 24, 6, 2, act)
    out = torch.zeros(23, 32)
    for tok in range(23):
        for j in range(2):
            e = idx[tok, j]
            up = x[tok] @ wu[e].T
            h = F.silu(x[tok] @ wg[e].T) * up if act == "silu" else F.relu(up) ** 2
            out[tok] += w[tok, j] * (h @ wd[e].T)
    torch.testing.assert_close(moe_experts_ref(x, w, idx, wu, wd, wg, act), out, atol=1e-5, rtol=1e-5)


def test_reference_refuses_a_gate_that_does_not_match_the_activation():
    x, w, idx, wu, wd, wg = _case(3, 16, 16, 4, 2, "silu")
    with pytest.raises(ValueError, match="expected silu with a gate"):
        moe_experts_ref(x, w, idx, wu, wd, None, "silu")
    with pytest.raises(ValueError, match="expected silu with a gate"):
        moe_experts_ref(x, w, idx, wu, wd, wg, "relu2")


@pytest.mark.parametrize("t, k, E", [(1, 2, 8), (5, 3, 4), (40, 6, 64), (7, 2, 16)])
def test_block_tables_cover_every_pair_once(t, k, E):
    moe = pytest.importorskip("ssmq.kernels.moe")
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(t)])
    order, be, bs, bend = moe.block_tables(idx, E)
    assert len(be) == -(-t * k // moe.BLOCK_M) + E  # the static worst case
    rows = torch.cat([torch.arange(s, e) for s, e in zip(bs.tolist(), bend.tolist())])
    assert sorted(rows.tolist()) == list(range(t * k))  # every sorted row in exactly one block
    flat = idx.reshape(-1)
    for e, s, end in zip(be.tolist(), bs.tolist(), bend.tolist()):
        assert end - s <= moe.BLOCK_M and (flat[order[s:end]] == e).all()  # one expert's pairs a block


@pytest.fixture(scope="module")
def MK():
    from test_kernels import kernel_module

    return kernel_module("moe")


def _kernel_cases():
    from test_kernels import DTYPES, INTERPRET

    shapes = [(1, 32, 24, 8, 2, False), (9, 48, 40, 6, 3, True), (33, 64, 48, 8, 2, False), (0, 32, 24, 4, 2, False)]
    if not INTERPRET:
        shapes += [(1, 1536, 512, 64, 6, False), (64, 1536, 512, 64, 6, False), (300, 2048, 768, 72, 10, True),
                   (2048, 1024, 256, 128, 6, False)]
    return [(*s, act, dt) for s in shapes for act in ("silu", "relu2") for dt in DTYPES]


@pytest.mark.gpu
@pytest.mark.parametrize("t, d, f, E, k, skew, act, dtype", _kernel_cases())
def test_kernel_matches_reference(MK, t, d, f, E, k, skew, act, dtype):
    from test_kernels import DEV, TOL, rel

    x, w, idx, wu, wd, wg = _case(t, d, f, E, k, act, dtype, DEV, skew=skew)
    out = MK.moe_experts(x, w, idx, wu, wd, wg, act)
    ref = moe_experts_ref(x, w, idx, wu, wd, wg, act)
    assert out.dtype == dtype and out.shape == (t, d)
    if t:
        assert rel(out, ref) <= TOL[dtype]


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph(MK):
    """Captured once, replayed for other routings of the same number of tokens: the eager result each time."""
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    x, w, idx, wu, wd, wg = _case(12, 64, 48, 8, 2, "silu", torch.float16, "cuda")
    static = [x.clone(), w.clone(), idx.clone()]
    MK.moe_experts(*static, wu, wd, wg, "silu")  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = MK.moe_experts(*static, wu, wd, wg, "silu")
    for seed in (1, 2, 3):
        x2, w2, idx2, *_ = _case(12, 64, 48, 8, 2, "silu", torch.float16, "cuda", seed=seed, skew=seed == 2)
        for buf, new in zip(static, (x2, w2, idx2)):
            buf.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, MK.moe_experts(x2, w2, idx2, wu, wd, wg, "silu"), atol=0, rtol=0)


def _quantize(w, fmt):
    """Stacked float weights (E, out, in) -> (codes, scales) in ``fmt`` (round to nearest, symmetric)."""
    codes, group, _ = (QFORMATS | G32)[fmt]
    E, n, k = w.shape
    g = group or k
    wg = w.float().reshape(E, n, k // g, g)
    if codes == "fp8":
        s = (wg.abs().amax(-1) / 448.0).clamp(min=1e-8)
        q = (wg / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(E, n, k)
    else:
        qmax = 7 if codes == "int4" else 127
        s = (wg.abs().amax(-1) / qmax).clamp(min=1e-8)
        q = torch.round(wg / s[..., None]).clamp(-qmax - 1, qmax).to(torch.int8).reshape(E, n, k)
        q = pack_int4(q) if codes == "int4" else q
    return q, (s if group else s.squeeze(-1))


def _qcase(t, d, f, E, k, act, fmt, dtype=torch.float32, device="cpu", seed=0, skew=False):
    """A routing and quantized experts: (x, weights, idx, w_up, w_down, w_gate, w_scales, act_fp8)."""
    x, w, idx, wu, wd, wg = _case(t, d, f, E, k, act, torch.float32, "cpu", seed, skew)
    (qu, su), (qd, sd) = _quantize(wu, fmt), _quantize(wd, fmt)
    qg, sg = _quantize(wg, fmt) if wg is not None else (None, None)
    to = lambda t_: None if t_ is None else t_.to(device)  # noqa: E731
    return (x.to(device, dtype), w.to(device), idx.to(device), to(qu), to(qd), to(qg), (to(su), to(sd), to(sg)),
            (QFORMATS | G32)[fmt][2])


@pytest.mark.parametrize("fmt", list(QFORMATS))
@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_quantized_reference_equals_the_quantized_linears(fmt, act):
    """Per (token, expert): the expert's linears as quant_linear_ref / quant_linear_act_ref compute them."""
    from ssmq.ops.quant_linear import quant_linear_act_ref, quant_linear_ref

    x, w, idx, qu, qd, qg, (su, sd, sg), fp8 = _qcase(9, 32, 48, 5, 2, act, fmt)

    def lin(v, q, s):
        return quant_linear_act_ref(v, q, s, None, True, torch.float8_e4m3fn) if fp8 else quant_linear_ref(v, q, s)

    out = torch.zeros(9, 32)
    for tok in range(9):
        for j in range(2):
            e = idx[tok, j]
            up = lin(x[tok:tok + 1], qu[e], su[e])
            h = F.silu(lin(x[tok:tok + 1], qg[e], sg[e])) * up if act == "silu" else F.relu(up) ** 2
            out[tok] += w[tok, j] * lin(h, qd[e], sd[e])[0]
    ref = moe_experts_ref(x, w, idx, qu, qd, qg, act, (su, sd, sg), fp8)
    torch.testing.assert_close(ref, out, atol=1e-5, rtol=1e-5)


def test_quantized_reference_refuses_mismatched_formats():
    x, w, idx, qu, qd, qg, (su, sd, sg), _ = _qcase(3, 32, 32, 4, 2, "silu", "int8")
    with pytest.raises(SSMQError, match="need their w_scales"):
        moe_experts_ref(x, w, idx, qu, qd, qg, "silu")
    with pytest.raises(SSMQError, match="fp8 activations need fp8"):
        moe_experts_ref(x, w, idx, qu, qd, qg, "silu", (su, sd, sg), True)
    with pytest.raises(SSMQError, match="gate None where there is no gate"):
        moe_experts_ref(x, w, idx, qu, qd, qg, "silu", (su, sd, None))


def _qkernel_cases():
    from test_kernels import DTYPES, INTERPRET

    shapes = [(1, 32, 48, 8, 2, False), (9, 64, 48, 6, 3, True), (0, 32, 32, 4, 2, False)]
    if not INTERPRET:
        shapes += [(1, 1536, 512, 64, 6, False), (64, 1536, 512, 64, 6, False), (1024, 1536, 512, 64, 6, True)]
    return [(*s, act, fmt, dt) for s in shapes for act in ("silu", "relu2") for fmt in QFORMATS for dt in DTYPES]


@pytest.mark.gpu
@pytest.mark.parametrize("t, d, f, E, k, skew, act, fmt, dtype", _qkernel_cases())
def test_quantized_kernel_matches_reference(MK, monkeypatch, t, d, f, E, k, skew, act, fmt, dtype):
    """Weight-only formats: the float kernel's tolerance (the same dequantized weights); FP8 W8A8: the fp8 linear's
    (an h rounded one ulp apart can take the next e4m3 code)."""
    from test_kernels import DEV, INTERPRET, TOL, rel

    if INTERPRET:  # its float -> e4m3 conversion does not round to nearest: the activation codes come from the ref
        from ssmq.ops.quant_linear import quantize_act_ref

        monkeypatch.setattr(MK, "quantize_act", quantize_act_ref)

    x, w, idx, qu, qd, qg, scales, fp8 = _qcase(t, d, f, E, k, act, fmt, dtype, DEV, skew=skew)
    out = MK.moe_experts(x, w, idx, qu, qd, qg, act, scales, fp8)
    ref = moe_experts_ref(x, w, idx, qu, qd, qg, act, scales, fp8)
    assert out.dtype == dtype and out.shape == (t, d)
    if t:
        assert rel(out, ref) <= (max(TOL[dtype], 4e-3) if fp8 else TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "fp8-w8a8"])
def test_quantized_kernel_reads_strided_rows(MK, monkeypatch, fmt):
    """x a view whose rows are further apart than d (its codes are not): the same result as contiguous x."""
    from test_kernels import DEV, INTERPRET

    if INTERPRET:
        from ssmq.ops.quant_linear import quantize_act_ref

        monkeypatch.setattr(MK, "quantize_act", quantize_act_ref)
    x, w, idx, qu, qd, qg, scales, fp8 = _qcase(7, 32, 48, 4, 2, "silu", fmt, torch.float16, DEV)
    wide = torch.cat([x, torch.randn_like(x)], 1)[:, :32]
    assert wide.stride(0) == 64
    torch.testing.assert_close(MK.moe_experts(wide, w, idx, qu, qd, qg, "silu", scales, fp8),
                               MK.moe_experts(x, w, idx, qu, qd, qg, "silu", scales, fp8), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int4-g16", "fp8-w8a8"])
def test_quantized_kernel_replays_in_a_cuda_graph(MK, fmt):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graphs need a GPU")
    x, w, idx, qu, qd, qg, scales, fp8 = _qcase(12, 64, 48, 8, 2, "silu", fmt, torch.float16, "cuda")
    static = [x.clone(), w.clone(), idx.clone()]
    MK.moe_experts(*static, qu, qd, qg, "silu", scales, fp8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = MK.moe_experts(*static, qu, qd, qg, "silu", scales, fp8)
    for seed in (1, 2):
        x2, w2, idx2, *_ = _qcase(12, 64, 48, 8, 2, "silu", fmt, torch.float16, "cuda", seed=seed, skew=seed == 2)
        for buf, new in zip(static, (x2, w2, idx2)):
            buf.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, MK.moe_experts(x2, w2, idx2, qu, qd, qg, "silu", scales, fp8), atol=0, rtol=0)


# the expert formats of the recipes as (WeightSpec, ActSpec) dicts; int4 in groups of 16 (the tiny widths)
MODULE_FORMATS = {
    "rtn-w8a16": ({"dtype": "int8"}, None),
    "w4a16-g16": ({"dtype": "int4", "granularity": "per_group:16"}, None),
    "fp8-w8a8": ({"dtype": "fp8"}, {"dtype": "fp8", "granularity": "per_token", "static": False}),
}


def _quant_moe(fmt, act="silu", d=64, hidden=48, experts=6, top_k=2, seed=0, dtype=torch.float32, device="cpu"):
    """A MoE block (tiny random config, a shared expert) whose experts' linears are ``QuantLinear``s in ``fmt`` (None:
    float)."""
    from ssmq.models.config import ModelConfig
    from ssmq.models.ffn import MoE
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import ActSpec, WeightSpec

    torch.manual_seed(seed)
    cfg = ModelConfig(arch="mamba2", d_model=d, n_layer=1, vocab_size=16, moe_layer_idx=(0,), moe_experts=experts,
                      moe_top_k=top_k, moe_hidden=hidden, moe_shared=True, mlp_hidden=32, moe_act=act)
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.router.weight)
    moe = moe.to(device, dtype)  # before quantizing: a cast would cast fp8 codes too
    if fmt is None:
        return moe
    wspec, aspec = MODULE_FORMATS[fmt]
    wspec, aspec = WeightSpec.from_dict(wspec), None if aspec is None else ActSpec.from_dict(aspec)
    for e in moe.experts:
        for name in moe._proj_names():
            setattr(e, name, QuantLinear.from_float(getattr(e, name), wspec, aspec))
    return moe


@pytest.mark.parametrize("fmt", list(MODULE_FORMATS))
@pytest.mark.parametrize("act", ["silu", "relu2"])
def test_grouped_quantized_experts_equal_the_routed_modules(fmt, act):
    """CPU: the grouped mode (stacked codes and scales through ``kernels.moe_experts``' reference) computes what the
    experts' own ``QuantLinear``s compute run on the tokens routed to them; the stacks are the modules' buffers."""
    moe = _quant_moe(fmt, act)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))
    assert moe.groupable()
    with torch.no_grad():
        ref = moe(x)
        moe.set_mode("grouped")
        out = moe(x)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    codes, scales = moe._stacked["down_proj"]
    assert moe.experts[2].down_proj.weight_q.data_ptr() == codes[2].data_ptr()
    assert moe.experts[2].down_proj.weight_scale.data_ptr() == scales[2].data_ptr()
    assert moe._act_fp8 == (fmt == "fp8-w8a8")


def test_experts_outside_the_kernels_formats_stay_static():
    """Int8 activations, per-tensor weight scales, mixed formats: not grouped (``static_shapes_`` runs them static)."""
    from ssmq.models.ffn import static_shapes_
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import ActSpec, WeightSpec

    moe = _quant_moe("rtn-w8a16")
    a8 = ActSpec.from_dict({"dtype": "int8", "granularity": "per_token", "static": False})
    lin = moe.experts[0].up_proj
    float_up = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    for swap in (QuantLinear.from_float(float_up, WeightSpec.from_dict({"dtype": "int8"}), a8),
                 QuantLinear.from_float(float_up, WeightSpec.from_dict({"dtype": "int8", "granularity": "per_tensor"})),
                 QuantLinear.from_float(float_up, WeightSpec.from_dict({"dtype": "int4",
                                                                        "granularity": "per_group:16"})),
                 float_up):
        moe.experts[0].up_proj = swap
        assert not moe.groupable()
        with pytest.raises(SSMQError, match="the grouped MoE runs float experts and"):
            moe.set_mode("grouped")
    static_shapes_(moe)
    assert moe.mode == "static"


def test_grouped_experts_quantized_after_stacking_are_refused():
    """Float experts stacked, then quantized: one clear error, not the old float weights; set again, they group."""
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import WeightSpec

    float_moe = _quant_moe(None)
    float_moe.set_mode("grouped")
    for e in float_moe.experts:
        for name in float_moe._proj_names():
            setattr(e, name, QuantLinear.from_float(getattr(e, name), WeightSpec.from_dict({"dtype": "int8"})))
    x = torch.randn(3, 64)
    with pytest.raises(SSMQError, match="changed .* after their weights were stacked"), torch.no_grad():
        float_moe(x)
    float_moe.set_mode("grouped")
    assert float_moe(x).shape == (3, 64)
    assert not float_moe.experts[0].up_proj.decode_copy
    float_moe.set_mode("static")  # run as modules again: their decode GEMV copies come back
    assert float_moe.experts[0].up_proj.decode_copy


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(MODULE_FORMATS))
@pytest.mark.parametrize("t", [1, 64, 300])
def test_grouped_quantized_moe_on_cuda_equals_the_modules(fmt, t):
    """CUDA: the grouped kernel equals the experts run as their own ``QuantLinear`` kernels, and is captured by a
    graph (what ``static_shapes_`` chooses it for)."""
    from test_kernels import rel

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ssmq.models.ffn import static_shapes_

    moe = _quant_moe(fmt, d=1536, hidden=512, experts=64, top_k=6, dtype=torch.float16, device="cuda")
    x = torch.randn(t, 1536, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        ref = moe(x)
        static_shapes_(moe)
        assert moe.mode == "grouped"
        out = moe(x)
        assert rel(out, ref) < (4e-3 if fmt == "fp8-w8a8" else 3e-3)
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(static_x)
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(captured, moe(static_x), atol=0, rtol=0)


# launch settings the table may hold (configs/moe.json): codes converted in 16 bits, scaled before or after the
# product, int4's x columns split three ways, the product swapped, 32-row blocks
VARIANTS = {
    "cvt": dict(CVT=1, POST=False, XS=2, SWAP=False),
    "cvt-post": dict(CVT=1, POST=True, XS=2, SWAP=False),
    "cvt-strided-x": dict(CVT=1, POST=False, XS=1, SWAP=False),
    "cvt-join-post-swap": dict(CVT=1, POST=True, XS=0, SWAP=True),
    "cvt-swap-bm32": dict(CVT=1, POST=False, XS=2, SWAP=True, BM=32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("fmt", ["int8", "int4-g32", "fp8"])
@pytest.mark.parametrize("t, skew", [(1, False), (40, True)])
def test_quantized_kernel_launch_variants_match_reference(MK, variant, fmt, t, skew):
    """Every conversion / scaling / product setting of the launch table computes the reference (16-bit x)."""
    from test_kernels import DEV, INTERPRET, rel

    v = dict(VARIANTS[variant])
    bm = v.pop("BM", 16)
    launch = {"BN": 32, "BK": 64, "warps": 4, "stages": 2, **v}
    table = {key: [{"max_rows": None, "BM": bm, "up": launch, "down": launch}]
             for key in ("int8", "int4", "fp8", "float32", "bfloat16")}
    for dtype in [torch.float16] + ([] if INTERPRET else [torch.bfloat16]):
        x, w, idx, qu, qd, qg, scales, fp8 = _qcase(t, 64, 96, 8, 2, "silu", fmt, dtype, DEV, skew=skew)
        out = MK.moe_experts(x, w, idx, qu, qd, qg, "silu", scales, fp8, cfg=table)
        ref = moe_experts_ref(x, w, idx, qu, qd, qg, "silu", scales, fp8)
        assert rel(out, ref) <= (3e-3 if dtype == torch.float16 else 2e-2)


def test_int4_tiles_narrower_than_32_columns_keep_the_float32_conversion():
    """Groups of 16 int4 columns (16-column tiles) convert codes in float32 whatever the table entry asks: the 16-bit
    conversion gave wrong results on an H100 there. Wider tiles take the entry's 16-bit conversion."""
    from ssmq.kernels.moe import launch_consts

    entry = {"CVT": 1, "POST": True, "XS": 2, "SWAP": True, "BN": 128, "BK": 128, "warps": 8, "stages": 3}
    narrow = launch_consts(entry, torch.float16, True, 2, False, 4, 16, 512)
    wide = launch_consts(entry, torch.float16, True, 2, False, 4, 128, 512)
    assert (narrow["CVT"], narrow["POST"], narrow["SWAP"], narrow["ASM_LO"]) == (0, 0, False, "")
    assert (wide["CVT"], wide["POST"], wide["SWAP"], wide["BLOCK_K"]) == (1, 1, True, 128) and wide["ASM_LO"]
