"""The low-bit linear kernels (``ssmq.kernels.quant_gemm``) equal ``ssmq.ops.quant_linear``'s references:
bit-exact where the arithmetic is integer (int8 / int4 x int8 -> int32, float32 epilogue), within fp16
rounding after the epilogue elsewhere. ``gpu`` tests; ``SSMQ_TRITON_INTERPRET=1`` runs a smaller sweep on CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from ssmq import ops
from ssmq.ops.quant_linear import pack_int4
from test_kernels import DEV, INTERPRET, kernel_module, rel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def QK():
    return kernel_module("quant_gemm")


def make_weight(n, k, bits, group, zero, fp8=False):
    """Random codes and scales in the stored layout: (w_q, w_scale, w_zero)."""
    shape = (n, k // group) if group else (n,)
    scale = torch.rand(shape, device=DEV) * 0.02 + 0.001
    if fp8:
        return (torch.randn(n, k, device=DEV) * 100).clamp(-448, 448).to(torch.float8_e4m3fn), scale, None
    lim = 8 if bits == 4 else 128
    codes = torch.randint(-lim, lim, (n, k), device=DEV, dtype=torch.int8)
    z = torch.randint(-lim, lim, shape, device=DEV, dtype=torch.int32) if zero else None
    return (pack_int4(codes) if bits == 4 else codes), scale, z


# SSMQ_GPU_QUICK=1: a shorter GPU sweep (one dtype, two shapes) for runs on a tight device budget
QUICK = os.environ.get("SSMQ_GPU_QUICK") == "1"
ROWS = [1, 3, 16, 17, 130] if INTERPRET else [1, 2, 5, 16, 17, 256] if QUICK else [1, 2, 5, 8, 16, 17, 64, 256]
N_K = [(40, 256)] if INTERPRET else [(100, 512), (333, 1024)] if QUICK else [(100, 512), (333, 1024), (2560, 5120)]
# (bits, group, zero): W8 per-channel sym / asym, W8 per-tensor, W4 g128 sym / asym, W4 g32
WFMTS = [(8, None, False), (8, None, True), (8, "tensor", False), (4, 128, False), (4, 128, True), (4, 32, False)]


def _weight(n, k, fmt):
    bits, group, zero = fmt
    if group == "tensor":
        w_q, _, _ = make_weight(n, k, bits, None, False)
        return w_q, torch.tensor(0.01, device=DEV), None
    return make_weight(n, k, bits, group, zero)


@pytest.mark.parametrize("fmt", WFMTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", N_K)
@pytest.mark.parametrize("dtype", [torch.float16] if INTERPRET or QUICK else [torch.float16, torch.bfloat16])
def test_weight_only(QK, fmt, rows, n, k, dtype):
    torch.manual_seed(rows)
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    out = QK.quant_linear(x, w_q, w_s, w_z, None, bias)
    ref = ops.quant_linear_ref(x, w_q, w_s, w_z, None, bias)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z, None, bias.double())  # no fp16 weight rounding
    assert out.dtype == dtype and out.shape == ref.shape
    # within fp16 / bf16 rounding: no further from the float64 result than the reference, plus an ulp
    eps = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert rel(out, exact) <= rel(ref, exact) + eps


@pytest.mark.skipif(INTERPRET, reason="the tiling is only filled at a GPU's SM count")
@pytest.mark.parametrize("fmt", [(8, None, False), (4, 128, False), (4, 128, True)])
@pytest.mark.parametrize("rows", [40, 64, 128, 300])
def test_weight_only_mid_rows_filled_tiling(QK, fmt, rows):
    # 17-64 rows: one row tile and a K split in two; 65-511 rows with enough column tiles for the SMs (N / 64 >=
    # 132): the Triton GEMM (int4 up to 128 rows with 4 warps), not the dequantize + cuBLAS route that underfilled
    # tilings take
    torch.manual_seed(rows)
    n, k = 8448, 512
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).half()
    out = QK.quant_linear(x, w_q, w_s, w_z)
    ref = ops.quant_linear_ref(x, w_q, w_s, w_z)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z)
    assert rel(out, exact) <= rel(ref, exact) + 2e-3


@pytest.mark.parametrize("fmt", [(8, None, False), (8, "tensor", False), (4, 128, False), (4, 32, False)])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", N_K + ([] if INTERPRET else [(64, 1000)]))  # odd k // 8: no int_mm
@pytest.mark.parametrize("per_token", [True, False])
def test_int8_activations_bit_exact(QK, fmt, rows, n, k, per_token):
    if fmt[0] == 4 and k % fmt[1]:
        pytest.skip("groups do not divide k")
    torch.manual_seed(rows + 7)
    w_q, w_s, _ = _weight(n, k, fmt)
    x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8)
    x_s = torch.rand(rows, device=DEV) * 0.1 if per_token else torch.tensor(0.05, device=DEV)
    bias = torch.randn(n, device=DEV)
    for out_dtype in (torch.float32, torch.float16):
        out = QK.quant_linear(x_q, w_q, w_s, None, x_s, bias, out_dtype)
        ref = ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, bias, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(out, ref), f"max diff {(out.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("rows", ROWS)
def test_int8_activations_triton_prefill_bit_exact(QK, rows):
    # the Triton int8 GEMM (not torch._int_mm) for per-channel weights, as PREFILL_A8="triton" runs it
    torch.manual_seed(3)
    n, k = N_K[0]
    w_q, w_s, _ = _weight(n, k, (8, None, False))
    x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8)
    x_s = torch.rand(rows, device=DEV)
    out = QK.quant_linear(x_q, w_q, w_s, None, x_s, None, torch.float32, cfg={"PREFILL_A8": "triton"})
    assert torch.equal(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, None, torch.float32))


@pytest.mark.skipif(INTERPRET, reason="fp8 needs a GPU (the interpreter has no e4m3 arithmetic)")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cublas_rows", [None, 2], ids=["shipped", "cublas-from-2"])
def test_fp8(QK, rows, cublas_rows):
    # fp8 x on the Triton kernels and on cuBLASLt's FP8 GEMM (FP8_CUBLAS_ROWS: from how many rows)
    torch.manual_seed(4)
    n, k = 256, 512
    w_q, w_s, _ = make_weight(n, k, 8, None, False, fp8=True)
    x = torch.randn(rows, k, device=DEV, dtype=torch.float16)
    x_q, x_s = ops.quantize_act_ref(x, None, True, torch.float8_e4m3fn)
    cfg = None if cublas_rows is None else {"FP8_CUBLAS_ROWS": cublas_rows}
    out = QK.quant_linear(x_q, w_q, w_s, None, x_s, None, torch.float16, cfg=cfg)
    ref = ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, None, torch.float16)
    assert rel(out, ref) < 2e-3
    out16 = QK.quant_linear(x, w_q, w_s, None, None, None)  # fp8 weight-only
    assert rel(out16, ops.quant_linear_ref(x, w_q, w_s)) < 2e-3


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [512, 2564])  # 2564: the K split's last part is shorter than a tile
def test_fp8_word_gemv(QK, rows, k):
    # decode rows of fp8 weights in the word GEMV: e4m3 codes converted exactly in registers, float32 products;
    # fp8 x (fp8-w8a8) and float x (fp8 weight-only)
    torch.manual_seed(rows)
    n = 200
    w_q, w_s, _ = make_weight(n, k, 8, None, False, fp8=True)
    x = torch.randn(rows, k, device=DEV, dtype=torch.float16)
    x_q, x_s = ops.quantize_act_ref(x, None, True, torch.float8_e4m3fn)
    bias = torch.randn(n, device=DEV)
    out = QK.quant_linear(x_q, w_q, w_s, None, x_s, bias, torch.float32)
    assert rel(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, bias, torch.float32)) < 1e-5
    exact = ops.quant_linear_ref(x.double(), w_q, w_s)
    assert rel(QK.quant_linear(x, w_q, w_s), exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("k", [40, 5120] if not INTERPRET else [40, 333])
@pytest.mark.parametrize("mode", ["token", "tensor", "static", "given_rows"])
@pytest.mark.parametrize("dtype", [torch.int8] if INTERPRET else [torch.int8, torch.float8_e4m3fn])
def test_quantize_act_bit_exact(QK, rows, k, mode, dtype):
    torch.manual_seed(k)
    x = (torch.randn(rows, k, device=DEV) * torch.rand(rows, 1, device=DEV) * 5).half()
    x[0, :3] = 0.0
    if rows > 1:
        x[1] = 0.0  # an all-zero row: scale EPS, codes 0
    s = {"static": torch.tensor(0.013, device=DEV),  # given rows: scales above the rows' own (a max over TP ranks)
         "given_rows": (x.float().abs().amax(-1) * torch.rand(rows, device=DEV).add(1) / 100).clamp(min=1e-8)
         }.get(mode)
    q, qs = QK.quantize_act(x, s, mode in ("token", "given_rows"), dtype)
    rq, rs = ops.quantize_act_ref(x, s, mode in ("token", "given_rows"), dtype)
    assert q.dtype == dtype and torch.equal(qs, rs)
    assert torch.equal(q.view(torch.int8), rq.view(torch.int8))


@pytest.mark.parametrize("fmt", WFMTS)
@pytest.mark.parametrize("n,k", [(48, 256), (70, 384)])
def test_dequantize_weight(QK, fmt, n, k):
    w_q, w_s, w_z = _weight(n, k, fmt)
    ref = ops.dequantize_weight(w_q, w_s, w_z).half()
    assert torch.equal(QK.dequantize_weight(w_q, w_s, w_z, torch.float16), ref)


@pytest.mark.parametrize("path", ["cublas", "triton"])
def test_prefill_paths(QK, path):
    torch.manual_seed(5)
    n, k = N_K[0]
    w_q, w_s, w_z = _weight(n, k, (4, 128, True))
    x = torch.randn(70, k, device=DEV).half()
    out = QK.quant_linear(x, w_q, w_s, w_z, cfg={"PREFILL_A16": path})
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z)
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z), exact) + 2e-3


def test_leading_dims_and_empty(QK):
    w_q, w_s, w_z = _weight(40, 256, (4, 128, True))
    x = torch.randn(2, 3, 256, device=DEV).half()
    out = QK.quant_linear(x, w_q, w_s, w_z)
    assert out.shape == (2, 3, 40)
    assert rel(out, ops.quant_linear_ref(x, w_q, w_s, w_z)) < 3e-3
    assert QK.quant_linear(x[:0], w_q, w_s, w_z).shape == (0, 3, 40)


@pytest.mark.parametrize("path", [{"FMA_MAX_ROWS": 2, "WORD_MAX_ROWS": 0}, {"FMA_MAX_ROWS": 0, "WORD_MAX_ROWS": 0},
                                  {"WORD_MAX_ROWS": 4}], ids=["cuda-core", "tensor-core", "words"])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("fmt", [(8, None, False), (4, 128, True), (4, 32, False)])
def test_decode_paths(QK, path, rows, fmt):
    # batch 1-2 runs on any decode kernel (CFG's WORD_MAX_ROWS / FMA_MAX_ROWS pick one): all equal the reference
    torch.manual_seed(rows + 11)
    n, k = N_K[0]
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).to(torch.float16)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z)
    out = QK.quant_linear(x, w_q, w_s, w_z, cfg=path)
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z), exact) + 2e-3
    if w_z is None:
        x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8)
        x_s = torch.rand(rows, device=DEV) * 0.1
        out = QK.quant_linear(x_q, w_q, w_s, None, x_s, None, torch.float32, cfg=path)
        assert torch.equal(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, None, torch.float32))


@pytest.mark.parametrize("fmt", [(8, None, False), (4, 128, False)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("scale", ["token", "static", "tensor"])
@pytest.mark.parametrize("act", [torch.int8] if INTERPRET else [torch.int8, torch.float8_e4m3fn])
def test_quant_linear_act(QK, fmt, rows, scale, act):
    # float x quantized inside the GEMM for decode rows (per token / static), by quantize_act beside it else:
    # the same codes, scales and integer products as the reference, so bit-exact for int8
    if act == torch.float8_e4m3fn and fmt[0] == 4:
        pytest.skip("fp8 activations pair with fp8 weights")
    torch.manual_seed(rows)
    n, k = N_K[0]
    if act == torch.float8_e4m3fn:
        w_q, w_s, _ = make_weight(n, k, 8, None, False, fp8=True)
    else:
        w_q, w_s, _ = _weight(n, k, fmt)
    x = (torch.randn(rows, k, device=DEV) * 3).half()
    x_s = torch.tensor(0.02, device=DEV) if scale == "static" else None
    bias = torch.randn(n, device=DEV)
    out = QK.quant_linear_act(x, w_q, w_s, x_s, scale == "token", act, bias, torch.float32,
                              cfg={"FUSE_ACT_QUANT": True})
    ref = ops.quant_linear_act_ref(x, w_q, w_s, x_s, scale == "token", act, bias, torch.float32)
    if act == torch.int8:
        assert torch.equal(out, ref), f"max diff {(out - ref).abs().max().item()}"
    else:  # fp8 products are summed in float32 in either order
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("fmt", [(4, 128, False), (4, 128, True), (4, 32, False)])
def test_int4_strided_x(QK, rows, fmt):
    # X_STRIDED: the int4 decode kernel loads x's even / odd columns apart; the same result as the split tile
    torch.manual_seed(rows + 5)
    n, k = N_K[0]
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).to(torch.float16)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z)
    out = QK.quant_linear(x, w_q, w_s, w_z, cfg={"X_STRIDED": True, "WORD_MAX_ROWS": 0})
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z), exact) + 2e-3
    if w_z is None and fmt[1] >= 64:
        x_s = torch.tensor(0.02, device=DEV)
        out = QK.quant_linear_act(x, w_q, w_s, x_s, False, torch.int8, None, torch.float32,
                                  cfg={"X_STRIDED": True, "FUSE_ACT_QUANT": True})
        assert torch.equal(out, ops.quant_linear_act_ref(x, w_q, w_s, x_s, False, torch.int8, None, torch.float32))


# The word-load decode GEMV (_qgemv_words, 1-4 rows, CFG's WORD_MAX_ROWS): codes read as 32-bit words, converted by
# bit assembly (float x) or multiplied by dp4a (int8 x); SPLIT_CFG splits k over as many programs as it allows,
# the partial sums added by the last program of each output tile.
SPLIT_CFG = {"WAVES_W": 10 ** 6, "MIN_SPLIT_K_W": 32, "KW_W": 4, "PREFETCH_W": True}
WORD_ROWS = [1, 3, 4] if INTERPRET else [1, 4] if QUICK else [1, 2, 3, 4]
WORD_N = [37] if INTERPRET else [10576] if QUICK else [37, 2560, 10576]  # 2560 x 5120, 10576 x 2560: Mamba2-2.7B


def _spy_words(QK, monkeypatch):
    calls = []
    real = QK._launch_words
    monkeypatch.setattr(QK, "_launch_words", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("fmt", WFMTS)
@pytest.mark.parametrize("rows", WORD_ROWS)
@pytest.mark.parametrize("n", WORD_N)
@pytest.mark.parametrize("split", [False, True])
def test_word_gemv(QK, monkeypatch, fmt, rows, n, split):
    # k = 200 (per channel / tensor): the last tile of words is partial (masked)
    k = 200 if fmt[1] in (None, "tensor") else 256
    if n > 37:
        k = 5120 if n == 2560 else 2560
    torch.manual_seed(rows + n)
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).half()
    bias = torch.randn(n, device=DEV).half()
    # the kernel itself at every row count and shape it can serve (CFG routes fewer to it by default)
    cfg = {**(SPLIT_CFG if split else {"MAX_SPLIT_W": 1}), "WORD_MAX_ROWS": 4, "WORD_8BIT_UNDERFILLED": False}
    calls = _spy_words(QK, monkeypatch)
    out = QK.quant_linear(x, w_q, w_s, w_z, None, bias, cfg=cfg)
    assert calls, "the word GEMV did not serve this call"
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z, None, bias.double())
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z, None, bias), exact) + 2e-3
    if w_z is None:  # int8 x: bit-exact, split or not (per-channel partials are exact int32 sums)
        x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8)
        x_s = torch.rand(rows, device=DEV) * 0.1
        out = QK.quant_linear(x_q, w_q, w_s, None, x_s, bias.float(), torch.float32, cfg=cfg)
        assert torch.equal(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, bias.float(), torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [(8, None, True), (4, 32, True)])
def test_word_gemv_x_dtypes(QK, dtype, fmt):
    # float32 x is read element by element, bfloat16 like float16 as int32 pairs
    torch.manual_seed(9)
    w_q, w_s, w_z = _weight(40, 256, fmt)
    x = torch.randn(2, 256, device=DEV).to(dtype)
    out = QK.quant_linear(x, w_q, w_s, w_z, cfg=SPLIT_CFG)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z)
    eps = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert out.dtype == dtype and rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z), exact) + eps


def test_word_gemv_falls_back(QK, monkeypatch):
    # rows of an int4 weight that are not whole 32-bit words (k = 100) and 5+ rows go to the other decode kernels
    calls = _spy_words(QK, monkeypatch)
    w_q, w_s, _ = _weight(24, 100, (4, None, False))
    x = torch.randn(1, 100, device=DEV).half()
    assert rel(QK.quant_linear(x, w_q, w_s), ops.quant_linear_ref(x.double(), w_q, w_s)) < 3e-3
    w_q, w_s, _ = _weight(24, 128, (4, 32, False))
    x = torch.randn(5, 128, device=DEV).half()
    assert rel(QK.quant_linear(x, w_q, w_s), ops.quant_linear_ref(x.double(), w_q, w_s)) < 3e-3
    assert not calls


@pytest.mark.skipif(INTERPRET or DEV != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("fmt", [(4, 128, False), (8, None, False)])
def test_split_under_graph_replays(QK, fmt, rows):
    # the K-split counters reset themselves: replays of a captured call stay right, for new x each time (1 row:
    # the word GEMV; 8 rows: _qmm with SPLIT_IN_KERNEL; int8 x at 8 rows is not split, bit-exactness forbids it)
    n, k = 2560, 5120
    torch.manual_seed(1)
    w_q, w_s, _ = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).half()
    x_q = torch.randint(-128, 128, (rows, k), device=DEV, dtype=torch.int8)
    x_s = torch.rand(rows, device=DEV) * 0.1
    f = {"bits": fmt[0], "fp8": False, "n": n, "k": k, "group_size": fmt[1]}
    plan = QK._plan_words if rows <= QK.CFG["WORD_MAX_ROWS"] else QK._plan
    assert plan(rows, n, k, f, 0, QK.sm_count(x.device), QK.CFG)["split"] > 1
    QK.quant_linear(x, w_q, w_s)  # compile and allocate outside the capture
    QK.quant_linear(x_q, w_q, w_s, None, x_s, None, torch.float32)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = QK.quant_linear(x, w_q, w_s)
        out_i = QK.quant_linear(x_q, w_q, w_s, None, x_s, None, torch.float32)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        x_q.copy_(torch.randint_like(x_q, -128, 128))
        graph.replay()
        exact = ops.quant_linear_ref(x.double(), w_q, w_s)
        assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3
        assert torch.equal(out_i, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, None, torch.float32))


@pytest.mark.parametrize("in_kernel", [True, False])
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("fmt", [(4, 128, True), (8, None, False)])
def test_qmm_split_sums(QK, in_kernel, rows, fmt):
    # the tensor-core decode kernel with K split: partials summed by its last program of each tile
    # (SPLIT_IN_KERNEL) or by _sum_splits after it; both equal the reference, bias included
    torch.manual_seed(rows)
    n, k = 40, 512
    w_q, w_s, w_z = _weight(n, k, fmt)
    x = torch.randn(rows, k, device=DEV).half()
    bias = torch.randn(n, device=DEV).half()
    cfg = {"WORD_MAX_ROWS": 0, "FMA_MAX_ROWS": 0, "MIN_SPLIT_K": 128, "SPLIT_IN_KERNEL": in_kernel}
    assert QK._plan(rows, n, k, {"bits": fmt[0], "fp8": False, "n": n, "k": k, "group_size": fmt[1]}, 0, 132,
                    {**QK.CFG, **cfg})["split"] > 1
    out = QK.quant_linear(x, w_q, w_s, w_z, None, bias, cfg=cfg)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s, w_z, None, bias.double())
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, w_z, None, bias), exact) + 2e-3
