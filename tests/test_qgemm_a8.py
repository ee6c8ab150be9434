"""The serving-batch int8-activation GEMM (``ssmq.kernels.qgemm_a8``) equals ``ops.quant_linear_ref`` bit for bit
(``int_matmul_ref``'s integer products and float32 epilogue) for int4 / int8 weight codes with per-group, per-channel
and per-tensor scales, per-token and per-tensor x scales, in every structural variant of its settings and every row
range of the shipped ones; and the dispatcher routes the rows its ROUTE gives it. ``gpu`` tests;
``SSMQ_TRITON_INTERPRET=1`` runs a smaller sweep on CPU. The sm_90 compile checks need no GPU."""

from __future__ import annotations

import pytest
import torch

from ssmq import ops
from ssmq.ops.quant_linear import pack_int4
from test_kernels import DEV, INTERPRET, kernel_module


@pytest.fixture(scope="module")
def QA():
    return kernel_module("qgemm_a8")


def _weight(n, k, bits, group, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lim = 8 if bits == 4 else 128
    codes = torch.randint(-lim, lim, (n, k), device=DEV, dtype=torch.int8, generator=g)
    shape = (n, k // group) if group else (n,) if group is None else ()
    scale = torch.rand(shape, device=DEV, generator=g) * 0.02 + 0.001
    return (pack_int4(codes) if bits == 4 else codes), scale


def _x(rows, k, per_token, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed + 7)
    x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8, generator=g)
    x_s = torch.rand((rows,) if per_token else (), device=DEV, generator=g) * 0.05 + 1e-3
    return x_q, x_s


def _variant(QA, **over):
    """CFG with every row range's entry overridden by ``over``."""
    return {key: [{**e, **over} for e in QA.CFG[key]] for key in ("ROWS_W4", "ROWS_W8")}


def _check(QA, x_q, x_s, w_q, w_s, bias=None, out_dtype=None, cfg=None):
    out = QA.quant_linear_a8(x_q, x_s, w_q, w_s, None, bias, out_dtype, cfg=cfg)
    ref = ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, bias, out_dtype)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max().item()}"


# (bits, group): group None per channel, 0 per tensor
FMTS = [(4, 128), (4, 64), (8, 128), (8, None), (4, None), (8, 0)]
FMT_IDS = {(4, 128): "w4g128", (4, 64): "w4g64", (8, 128): "w8g128", (8, None): "w8ch", (4, None): "w4ch",
           (8, 0): "w8t"}
VARIANTS = [dict(SWAP=s, X_SPLIT=x, GPS=1 + (x == 0)) for s in (True, False) for x in (0, 1, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}{int(x)}" for k, x in v.items()))
@pytest.mark.parametrize("fmt", FMTS[:3] if INTERPRET else FMTS, ids=FMT_IDS.get)
def test_variants_bit_exact(QA, variant, fmt):
    bits, group = fmt
    if bits == 8 and variant["X_SPLIT"]:
        pytest.skip("X_SPLIT means nothing for int8 codes")
    n, k = (72, 256) if INTERPRET else (200, 512)
    w_q, w_s = _weight(n, k, bits, group)
    bias = torch.randn(n, device=DEV)
    for rows, per_token in ((17, True), (40, False)) if INTERPRET else ((16, True), (40, False), (100, True)):
        x_q, x_s = _x(rows, k, per_token)
        _check(QA, x_q, x_s, w_q, w_s, bias, cfg=_variant(QA, **variant))


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="the shipped tiles are too large for the interpreter")
@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS.get)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 15, 16, 17, 32, 33, 64, 100, 128, 200, 256, 1000, 4096])
@pytest.mark.parametrize("n,k", [(200, 512), (2560, 5120), (10576, 2560)])
def test_shipped_settings_bit_exact(QA, fmt, rows, n, k):
    # every row range of the settings in force (decode rows below 16 padded into the first entry's tiles; past 256:
    # prefill rows, routed here for int4), odd column counts, fp16 out as the models ask; twice: a K split's
    # counters must be left at zero for the next launch
    w_q, w_s = _weight(n, k, *fmt, seed=rows)
    x_q, x_s = _x(rows, k, rows % 2 == 0, seed=rows)
    for _ in range(2):
        _check(QA, x_q, x_s, w_q, w_s, None, torch.float16)


@pytest.mark.gpu
def test_split_forced(QA):
    # per-channel codes: int32 partials of a K split add exactly
    n, k = (72, 1024) if INTERPRET else (200, 2048)
    w_q, w_s = _weight(n, k, 4, None)
    x_q, x_s = _x(24, k, True)
    cfg = {"ROWS_W4": [{**e, "waves": 64, "BK": 64, "GPS": 2} for e in QA.CFG["ROWS_W4"]], "MIN_SPLIT_K": 64}
    f = QA.weight_format(w_q, w_s)
    plan = QA._plan(24, n, k, f, 132, {**QA.CFG, **cfg})
    assert plan["split"] > 1 and plan["GPS"] == 2
    for _ in range(2):
        _check(QA, x_q, x_s, w_q, w_s, torch.randn(n, device=DEV), torch.float16, cfg=cfg)


@pytest.mark.gpu
def test_fill_narrows_column_tiles(QA):
    # a narrow output under fill x SMs tiles takes narrower column tiles (down to 16), grouped sums unsplit
    n, k = (72, 256) if INTERPRET else (2560, 5120)
    w_q, w_s = _weight(n, k, 4, 128)
    x_q, x_s = _x(16, k, False)
    cfg = {"ROWS_W4": [{**e, "BN": 64, "fill": 64, "GPS": 2} for e in QA.CFG["ROWS_W4"]]}
    plan = QA._plan(16, n, k, QA.weight_format(w_q, w_s), 132, {**QA.CFG, **cfg})
    assert plan["BLOCK_N"] == 16 and plan["split"] == 1 and plan["GPS"] == 2
    _check(QA, x_q, x_s, w_q, w_s, None, torch.float16, cfg=cfg)


@pytest.mark.gpu
def test_leading_dims_and_strided_rows(QA):
    n, k = (72, 256) if INTERPRET else (200, 512)
    w_q, w_s = _weight(n, k, 4, 128)
    x_q, _ = _x(2 * 9, k + 64, False)
    x_q = x_q[:, :k].reshape(2, 9, k)[:, :, :]  # rows strided by k + 64
    x_s = torch.rand(2, 9, device=DEV) + 0.01
    out = QA.quant_linear_a8(x_q, x_s, w_q, w_s, cfg=_variant(QA, BM=16))
    assert torch.equal(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s))


@pytest.mark.gpu
def test_routing(QA, monkeypatch):
    # the dispatcher sends the rows of ROUTE here and the rest (float x, zero points, other rows) elsewhere
    from ssmq.kernels import dispatch

    n, k = (72, 256)
    w_q, w_s = _weight(n, k, 4, 128)
    monkeypatch.setitem(QA.CFG, "ROUTE", {"int4": [17, 64]})
    x_q, x_s = _x(40, k, True)
    assert QA.serves(x_q, w_q, w_s, None, x_s) is not None
    assert QA.serves(x_q[:16], w_q, w_s, None, x_s[:16]) is None
    assert QA.serves(x_q, w_q, w_s, None, x_s[:3]) is None  # a scale of neither shape
    assert QA.serves(x_q.float(), w_q, w_s, None, x_s) is None
    assert QA.serves(x_q, w_q, w_s, torch.zeros_like(w_s, dtype=torch.int32), x_s) is None
    w8, s8 = _weight(n, k, 8, 128)
    assert QA.serves(x_q, w8, s8, None, x_s) is None  # int8 not routed in this ROUTE
    assert QA.serves_codes(torch.randn(40, k, device=DEV), w_q, w_s, torch.int8)
    assert not QA.serves_codes(torch.randn(40, k, device=DEV), w_q, w_s, torch.float8_e4m3fn)
    if DEV == "cuda":
        calls = []
        monkeypatch.setattr(QA, "quant_linear_a8", lambda *a, **kw: calls.append(1) or torch.zeros(1))
        dispatch.quant_linear(x_q, w_q, w_s, None, x_s)
        dispatch.quant_linear_act(torch.randn(40, k, device=DEV), w_q, w_s)
        assert len(calls) == 2


def test_table_reads_its_rows_from_the_config():
    from ssmq.kernels.dispatch import quant_linear_a8_rows, select

    rows = quant_linear_a8_rows(dict(ROUTE=dict(int4=[16, 256], int8=[17, 64])))
    call = dict(code="int4", x="int8", rows=32, zero=False, fits=True)
    assert select(rows, call) == "qgemm_a8"
    assert select(rows, call | dict(rows=15)) == "quant_gemm"
    assert select(rows, call | dict(rows=257)) == "quant_gemm"
    assert select(rows, call | dict(code="int8", rows=16)) == "quant_gemm"
    assert select(rows, call | dict(code="int8", rows=64)) == "qgemm_a8"
    assert select(rows, call | dict(code="fp8")) == "quant_gemm"
    assert select(rows, call | dict(x="float16")) == "quant_gemm"
    assert select(rows, call | dict(zero=True)) == "quant_gemm"
    assert select(rows, call | dict(fits=False)) == "quant_gemm"


def test_shipped_settings():
    import json

    from ssmq.kernels import configs

    data = json.loads(configs.path("qgemm_a8").read_text())
    for settings in data["devices"].values():
        assert set(settings["ROUTE"]) <= {"int4", "int8"}
        for key in ("ROWS_W4", "ROWS_W8"):
            assert [e["max_rows"] for e in settings[key]] == sorted(e["max_rows"] for e in settings[key])
            assert all(e["BK"] & (e["BK"] - 1) == 0 and e["BM"] >= 16 and e["BN"] >= 16 for e in settings[key])


# (int4, WS_MODE, SWAP, X_SPLIT, BLOCK_M, BLOCK_N, SPLIT, GPS)
COMPILE = {
    "w4-group-swap-join": (True, 2, True, 0, 32, 64, False, 2),
    "w4-group-swap-strided": (True, 2, True, 1, 16, 64, False, 1),
    "w4-group-plain-split-x": (True, 2, False, 2, 128, 64, False, 1),
    "w4-channel-plain-split": (True, 1, False, 0, 32, 32, True, 2),
    "w8-group-swap": (False, 2, True, 0, 64, 64, False, 4),
    "w8-tensor-plain-split": (False, 0, False, 0, 64, 128, True, 1),
}


@pytest.mark.parametrize("variant", sorted(COMPILE))
def test_compiles_for_sm90(variant):
    """Each structural variant builds for an H100 with its int8 products on tensor cores (warp-group instructions
    where a 64-row side allows, else mma.sync), the weight codes loaded asynchronously, no FMA in the epilogue."""
    pytest.importorskip("triton")
    from ssmq.kernels.build import compile_sm90
    from ssmq.kernels.qgemm_a8 import _a8_qmm

    if INTERPRET or not hasattr(_a8_qmm, "arg_names"):
        pytest.skip("kernels are interpreted in this session (SSMQ_TRITON_INTERPRET=1)")

    w4, ws_mode, swap, x_split, bm, bn, split, gps = COMPILE[variant]
    pointers = {"x_ptr": "i8", "xs_ptr": "fp32", "w_ptr": "u8" if w4 else "i8", "ws_ptr": "fp32", "b_ptr": "fp32",
                "out_ptr": "fp16", "part_ptr": "i32", "cnt_ptr": "i32"}
    const = dict(W4=w4, WS_MODE=ws_mode, XS_ROWS=True, HAS_BIAS=True, SPLIT=split, NSP=4 if split else 1, PTX=True,
                 MAGIC=2 if ws_mode == 2 and w4 else int(ws_mode == 2), SWAP=swap, X_SPLIT=x_split,
                 GPS=gps, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, USE_GDC=True)
    aligned = ("x_ptr", "xs_ptr", "w_ptr", "ws_ptr", "b_ptr", "out_ptr", "part_ptr", "cnt_ptr", "M", "N", "K",
               "k_split", "s_xm", "s_wn", "s_om")
    try:
        compiled = compile_sm90(_a8_qmm, pointers, const, aligned=aligned, fp_fusion=False)
    except (FileNotFoundError, RuntimeError) as e:
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise
    assert compiled.asm["cubin"]
    ptx = compiled.asm["ptx"]
    wgmma = (bn if swap else bm) >= 64
    assert ("wgmma.mma_async" in ptx and ".s8" in ptx) if wgmma else "mma.sync.aligned.m16n8k32" in ptx
    assert "cp.async" in ptx
    if ws_mode == 2:
        assert "fma.rn.f32" not in ptx and "cvt.rn.f32.s32" not in ptx  # magic-number conversion, no contraction
