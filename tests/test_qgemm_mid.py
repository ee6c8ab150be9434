"""The serving-batch weight-only GEMM (``ssmq.kernels.qgemm_mid``) equals ``ops.quant_linear_ref`` within 16-bit
rounding, for every structural variant of its settings, and the dispatcher routes the rows its ROUTE gives it.
``gpu`` tests; ``SSMQ_TRITON_INTERPRET=1`` runs a smaller sweep on CPU."""

from __future__ import annotations

import pytest
import torch

import os

from ssmq import ops
from ssmq.ops.quant_linear import pack_int4
from test_kernels import DEV, INTERPRET, kernel_module, rel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def QM():
    return kernel_module("qgemm_mid")


def _weight(n, k, bits, group):
    lim = 8 if bits == 4 else 128
    codes = torch.randint(-lim, lim, (n, k), device=DEV, dtype=torch.int8)
    scale = torch.rand((n, k // group) if group else (n,), device=DEV) * 0.02 + 0.001
    return (pack_int4(codes) if bits == 4 else codes), scale


def _variant(QM, **over):
    """CFG with every row range's entry overridden by ``over``."""
    return {key: [{**e, **over} for e in QM.CFG[key]] for key in ("ROWS_W4", "ROWS_W8")}


# SWAP x X_SPLIT x POST_SCALE (X_SPLIT and POST_SCALE only mean something for int4 / per-group codes)
# SSMQ_GPU_QUICK=1: a shorter GPU sweep for runs on a tight device budget
QUICK = os.environ.get("SSMQ_GPU_QUICK") == "1"
VARIANTS = [dict(SWAP=s, X_SPLIT=x, POST_SCALE=p) for s in (True, False) for x in (0, 1, 2) for p in (False, True)
            if not QUICK or (s, x, p) in ((True, 0, False), (True, 1, False), (True, 2, False), (True, 0, True),
                                          (False, 2, False))]
FMTS = [(4, 128), (4, 32), (8, None), (8, 64)]
ROWS = [17, 40, 3] if INTERPRET else [40, 256, 2, 8] if QUICK else [16, 17, 32, 64, 100, 128, 256, 512, 2, 5, 8]
N_K = [(72, 256)] if INTERPRET else [(200, 512), (2560, 5120)] if QUICK else [(200, 512), (2560, 5120), (10576, 2560)]
DTYPES = [torch.float16] if INTERPRET else [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}{int(x)}" for k, x in v.items()))
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_variants_match_reference(QM, variant, fmt, dtype):
    bits, group = fmt
    if bits == 8 and (variant["X_SPLIT"] or (variant["POST_SCALE"] and group is None)):
        pytest.skip("the variant means nothing for int8 codes")
    torch.manual_seed(1)
    n, k = N_K[0]
    w_q, w_s = _weight(n, k, bits, group)
    bias = torch.randn(n, device=DEV).to(dtype)
    for rows in ROWS[:2]:
        x = torch.randn(rows, k, device=DEV).to(dtype)
        out = QM.quant_linear_mid(x, w_q, w_s, None, bias, cfg=_variant(QM, **variant))
        ref = ops.quant_linear_ref(x, w_q, w_s, None, None, bias)
        exact = ops.quant_linear_ref(x.double(), w_q, w_s, None, None, bias.double())
        assert out.dtype == dtype and out.shape == ref.shape and not out.isnan().any()
        # within 16-bit rounding: no further from the float64 result than the reference, plus an ulp
        assert rel(out, exact) <= rel(ref, exact) + (2e-3 if dtype == torch.float16 else 1.6e-2)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n,k", N_K)
def test_shapes_and_splits(QM, fmt, rows, n, k):
    # the settings in force (K split where the tiles underfill the SMs, row tiles of 16-128), fp16, no bias
    torch.manual_seed(rows)
    w_q, w_s = _weight(n, k, *fmt)
    x = torch.randn(rows, k, device=DEV).half()
    for _ in range(2):  # twice: the split's counters must be left at zero for the next launch
        out = QM.quant_linear_mid(x, w_q, w_s)
        exact = ops.quant_linear_ref(x.double(), w_q, w_s)
        assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3


@pytest.mark.parametrize("fmt", FMTS)
def test_groups_a_step(QM, fmt):
    # two tiles a loop step (GPS 2, as the tuning sweep offers), with and without a K split (each split's share a
    # whole number of loop steps)
    torch.manual_seed(3)
    n, k = N_K[0]
    w_q, w_s = _weight(n, k, *fmt)
    x = torch.randn(ROWS[1], k, device=DEV).half()
    exact = ops.quant_linear_ref(x.double(), w_q, w_s)
    for waves, min_k in ((1, 512), (64, 32)):
        cfg = {**_variant(QM, GPS=2, waves=waves), "MIN_SPLIT_K": min_k}
        plan = QM._plan(x.shape[0], n, k, QM.weight_format(w_q, w_s), 132, {**QM.CFG, **cfg})
        assert plan["k_split"] % (plan["GPS"] * plan["BLOCK_K"]) == 0 and plan["GPS"] > 1
        out = QM.quant_linear_mid(x, w_q, w_s, cfg=cfg)
        assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3


def test_split_forced(QM):
    torch.manual_seed(2)
    n, k = N_K[0]
    w_q, w_s = _weight(n, k, 4, 32)
    x = torch.randn(ROWS[0], k, device=DEV).half()
    cfg = {"ROWS_W4": [{**e, "waves": 64} for e in QM.CFG["ROWS_W4"]], "MIN_SPLIT_K": 32}
    f = QM.weight_format(w_q, w_s)
    assert QM._plan(x.shape[0], n, k, f, 132, {**QM.CFG, **cfg})["split"] > 1
    out = QM.quant_linear_mid(x, w_q, w_s, cfg=cfg)
    exact = ops.quant_linear_ref(x.double(), w_q, w_s)
    assert rel(out, exact) <= rel(ops.quant_linear_ref(x, w_q, w_s), exact) + 2e-3


def test_routing(QM, monkeypatch):
    # the dispatcher sends the rows of ROUTE here and the rest (zero points, float32 x, other rows) elsewhere
    from ssmq.kernels import dispatch

    n, k = N_K[0]
    w_q, w_s = _weight(n, k, 4, 128)
    monkeypatch.setitem(QM.CFG, "ROUTE", {"int4": [17, 64]})
    x = torch.randn(40, k, device=DEV).half()
    assert QM.serves(x, w_q, w_s) is not None
    assert QM.serves(x[:16], w_q, w_s) is None
    assert QM.serves(x.float(), w_q, w_s) is None
    assert QM.serves(x, w_q, w_s, torch.zeros_like(w_s, dtype=torch.int32)) is None
    assert QM.serves(torch.randn(40, k + 32, device=DEV).half()[:, :k], w_q, w_s) is not None  # strided rows
    w8, s8 = _weight(n, k, 8, None)
    assert QM.serves(x, w8, s8) is None  # int8 not routed in this ROUTE
    if DEV == "cuda":
        calls = []
        monkeypatch.setattr(QM, "quant_linear_mid", lambda *a, **kw: calls.append(1) or torch.zeros(1))
        dispatch.quant_linear(x, w_q, w_s)
        assert calls
