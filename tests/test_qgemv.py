"""The low-bit decode GEMV (``ssmq.kernels.qgemv``) equals ``ops.quant_linear_ref``: within fp16 / bf16 rounding of
the float64 result for float x, to float32 rounding for fp8 x; both paths (FMA, DOT), K split or not, and the
routing of ``kernels.dispatch.quant_linear`` to it. ``gpu`` tests; ``SSMQ_TRITON_INTERPRET=1`` runs a smaller
sweep on CPU.
"""

from __future__ import annotations

import pytest
import torch

from ssmq import ops
from ssmq.ops.quant_linear import weight_format
from test_kernels import DEV, INTERPRET, kernel_module, rel
from test_quant_kernels import make_weight

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def QG():
    return kernel_module("qgemv")


def _weight(n, k, fmt):
    bits, group = fmt
    if group == "tensor":
        w_q, _, _ = make_weight(n, k, bits, None, False)
        return w_q, torch.tensor(0.01, device=DEV)
    w_q, w_s, _ = make_weight(n, k, bits, group, False)
    return w_q, w_s


FMTS = [(4, 128), (4, 32), (8, None), (8, "tensor")]
ROWS = [1, 2, 3, 4, 8]
SHAPES = [(40, 1024)] if INTERPRET else [(40, 1024), (10576, 2560)]  # 10576 x 2560: Mamba2-2.7B in_proj
# FMA (1-4 rows) / DOT (3-8 rows) x (K split with one tile a program, one program a column tile looping over k)
PATHS = {"fma": {"FMA_MAX_ROWS": 4}, "dot": {"FMA_MAX_ROWS": 2}}
SPLITS = {"split": {"MAX_ITERS": 1}, "loop": {"MAX_SPLIT_FMA": 1, "MAX_SPLIT_DOT": 1}, "default": {}}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_weight_only(QG, n, k, fmt, rows, path, split):
    if (path == "fma") != (rows <= 4) and rows not in (3, 4):
        pytest.skip("the FMA path serves 1-4 rows")
    torch.manual_seed(rows + n)
    w_q, w_s = _weight(n, k, fmt)
    f = weight_format(w_q, w_s)
    cfg = {**QG.CFG, **PATHS[path], **SPLITS[split]}
    plan = QG._plan(rows, n, k, f, 132, cfg)
    assert plan["DOT"] == (rows > cfg["FMA_MAX_ROWS"])
    if split != "default" and n == 40:
        tiles = k // plan["KT"]
        assert tiles > 1 and (plan["split"], plan["iters"]) == ((tiles, 1) if split == "split" else (1, tiles))
    for dtype in [torch.float16] if INTERPRET or n > 40 else [torch.float16, torch.bfloat16]:
        x = torch.randn(rows, k, device=DEV).to(dtype)
        bias = torch.randn(n, device=DEV).to(dtype)
        assert QG.eligible(x, w_q, w_s, None, f, cfg)
        out = QG.quant_gemv(x, w_q, w_s, f, None, bias, cfg=cfg)
        exact = ops.quant_linear_ref(x.double(), w_q, w_s, None, None, bias.double())
        eps = 2e-3 if dtype == torch.float16 else 1.6e-2
        assert out.dtype == dtype and out.shape == (rows, n)
        assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s, None, None, bias), exact) + eps


@pytest.mark.skipif(INTERPRET, reason="fp8 needs a GPU (the interpreter has no e4m3 arithmetic)")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k", [(200, 512), (2560, 5120)])
def test_fp8(QG, n, k, rows, path):
    # fp8 x codes (FP8 W8A8) and float x (fp8 weight-only): e4m3 products exact in float32
    torch.manual_seed(rows)
    w_q, w_s, _ = make_weight(n, k, 8, None, False, fp8=True)
    f = weight_format(w_q, w_s)
    cfg = {**QG.CFG, **PATHS[path]}
    x = torch.randn(rows, k, device=DEV, dtype=torch.float16)
    x_q, x_s = ops.quantize_act_ref(x, None, True, torch.float8_e4m3fn)
    bias = torch.randn(n, device=DEV)
    assert QG.eligible(x_q, w_q, w_s, None, f, cfg)
    out = QG.quant_gemv(x_q, w_q, w_s, f, x_s, bias, torch.float32, cfg=cfg)
    assert rel(out, ops.quant_linear_ref(x_q, w_q, w_s, None, x_s, bias, torch.float32)) < 1e-5
    exact = ops.quant_linear_ref(x.double(), w_q, w_s)
    out16 = QG.quant_gemv(x, w_q, w_s, f, cfg=cfg)
    assert rel(out16, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3


def test_serves(QG, monkeypatch):
    # kernels.dispatch.quant_linear sends a call here when ``serves`` returns its weight format: routed rows
    # (ROUTE_ROWS) of a format the kernel serves; zero points, float32 x, int8 x, fp8 x without its scale, k without
    # a whole tile and more than MAX_ROWS rows go to quant_gemm's kernels
    monkeypatch.setitem(QG.CFG, "ROUTE_ROWS", QG.ALL_ROWS)
    w_q, w_s = _weight(24, 256, (4, 128))
    x = torch.randn(1, 2, 256, device=DEV).half()
    f = QG.serves(x, w_q, w_s)
    assert f is not None and f["group_size"] == 128
    out = QG.quant_gemv(x, w_q, w_s, f)
    assert out.shape == (1, 2, 24) and rel(out, ops.quant_linear_ref(x.double(), w_q, w_s)) < 3e-3
    assert QG.serves(x, w_q, w_s, torch.zeros(w_s.shape, device=DEV, dtype=torch.int32)) is None
    assert QG.serves(x.float(), w_q, w_s) is None
    assert QG.serves(torch.zeros(2, 256, device=DEV, dtype=torch.int8), w_q, w_s, None, torch.ones(())) is None
    assert QG.serves(torch.randn(9, 256, device=DEV).half(), w_q, w_s) is None
    w8, s8 = _weight(24, 200, (8, None))  # k = 200: no 16-byte tile divides it
    assert QG.serves(torch.randn(1, 200, device=DEV).half(), w8, s8) is None
    monkeypatch.setitem(QG.CFG, "ROUTE_ROWS", dict(QG.ALL_ROWS, int4=1))  # 2 rows of int4: not routed here
    assert QG.serves(x, w_q, w_s) is None


@pytest.mark.skipif(INTERPRET, reason="kernels.dispatch runs the references on CPU tensors")
def test_dispatch_routes_here(QG, monkeypatch):
    # the shipped routing: 8-bit codes at one row through kernels.quant_linear / quant_linear_act come here
    from ssmq import kernels

    calls = []
    real = QG.quant_gemv
    monkeypatch.setattr(QG, "quant_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w8, s8 = _weight(64, 512, (8, None))
    x = torch.randn(1, 512, device=DEV).half()
    assert rel(kernels.quant_linear(x, w8, s8), ops.quant_linear_ref(x.double(), w8, s8)) < 3e-3
    assert len(calls) == 1
    wf, sf, _ = make_weight(64, 512, 8, None, False, fp8=True)
    out = kernels.quant_linear_act(x, wf, sf, None, True, torch.float8_e4m3fn)
    ref = ops.quant_linear_act_ref(x, wf, sf, None, True, torch.float8_e4m3fn)
    assert len(calls) == 2 and out.dtype == x.dtype and rel(out, ref) < 2e-3
    x2 = torch.randn(2, 512, device=DEV).half()
    assert rel(kernels.quant_linear(x2, w8, s8), ops.quant_linear_ref(x2.double(), w8, s8)) < 3e-3
    assert len(calls) == 2  # 2 rows: quant_gemm's kernels


@pytest.mark.skipif(INTERPRET or DEV != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("fmt", [(4, 128), (8, None)])
def test_split_under_graph_replays(QG, fmt, rows):
    # the K-split counters reset themselves: replays of a captured call stay right for new x each time
    n, k = 2560, 5120
    torch.manual_seed(1)
    w_q, w_s = _weight(n, k, fmt)
    f = weight_format(w_q, w_s)
    x = torch.randn(rows, k, device=DEV).half()
    assert QG._plan(rows, n, k, f, QG.sm_count(x.device), QG.CFG)["split"] > 1
    QG.quant_gemv(x, w_q, w_s, f)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = QG.quant_gemv(x, w_q, w_s, f)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        exact = ops.quant_linear_ref(x.double(), w_q, w_s)
        assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3
