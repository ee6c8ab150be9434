"""The low-bit linear's prefill shortcut (``dispatch.quant_linear``): calls of more rows than any selection table
routes for x's dtype (``dispatch._routed_rows``) go straight to quant_gemm's kernels without reading the tables,
which must change no route: every table sends those rows to quant_gemm (or the stored codes), and a table widened
past the limit widens the limit."""

from __future__ import annotations

import pytest
import torch

from ssmq.kernels import dispatch
from ssmq.kernels.dispatch import select

pytest.importorskip("triton")


def _tables():
    k = dispatch._kernels
    return (k("qgemv").CFG, k("packed_gemv").CFG, k("qgemm_mid").CFG, k("qgemm_a8").CFG)


X = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}


@pytest.mark.parametrize("x", sorted(X))
@pytest.mark.parametrize("code", ["int4", "int8", "fp8"])
def test_no_table_routes_past_the_limit(code, x, monkeypatch):
    # every table bounded (int4 codes with int8 x have no upper bound in the shipped qgemm_a8 table)
    a8_ = dispatch._kernels("qgemm_a8")
    monkeypatch.setitem(a8_.CFG, "ROUTE", {c: [lo, min(hi, 512)] for c, (lo, hi) in a8_.CFG["ROUTE"].items()})
    qgemv, packed, mid, a8 = _tables()
    limit = dispatch._routed_rows(X[x])
    assert limit >= 1
    for rows in (limit + 1, 4 * limit, 8192):
        call = dict(code=code, x=x, rows=rows, zero=False, fits=True)
        for group in (128, None):
            assert select(dispatch.quant_linear_rows(qgemv), call | dict(group=group, x_scaled=True)) == "quant_gemm"
        assert select(dispatch.packed_linear_rows(packed), call) == "stored"
        assert select(dispatch.quant_linear_mid_rows(mid), call) == "quant_gemm"
        assert select(dispatch.quant_linear_a8_rows(a8), call) == "quant_gemm"
    # at the limit some table routes x of this dtype: the limit is not larger than it needs to be
    assert any(select(t(c), dict(code=code_, x=x, rows=limit, zero=False, fits=True, group=group, x_scaled=True))
               not in ("quant_gemm", "stored")
               for t, c in ((dispatch.quant_linear_rows, qgemv), (dispatch.packed_linear_rows, packed),
                            (dispatch.quant_linear_mid_rows, mid), (dispatch.quant_linear_a8_rows, a8))
               for code_ in ("int4", "int8", "fp8") for group in (128, None))


def test_limit_follows_the_dtype_of_x():
    # 16-bit x: the decode GEMVs and qgemm_mid bound it; int8 codes: qgemm_a8's int4 rows, unbounded as shipped
    assert dispatch._routed_rows(torch.float16) <= 4096
    assert dispatch._routed_rows(torch.int8) >= 1 << 20


def test_widened_table_widens_the_limit(monkeypatch):
    mid = dispatch._kernels("qgemm_mid")
    monkeypatch.setitem(mid.CFG, "ROUTE", {**mid.CFG["ROUTE"], "int8": [16, 4096]})
    assert dispatch._routed_rows(torch.float16) == 4096


def test_prefill_call_skips_the_tables(monkeypatch):
    # on a (pretended) GPU, a 1024-row call reaches quant_gemm without any table's check running
    calls = []
    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    monkeypatch.setattr(dispatch._kernels("quant_gemm"), "quant_linear", lambda *a: calls.append(a[0].shape) or "qg")

    def refuse(*a, **k):
        raise AssertionError("a selection table was read for a prefill call")

    for name in ("qgemv", "qgemm_mid", "qgemm_a8"):
        monkeypatch.setattr(dispatch._kernels(name), "serves", refuse)
    monkeypatch.setattr(dispatch._kernels("packed_gemv"), "launch", refuse)
    rows = dispatch._routed_rows(torch.float16) + 1
    x = torch.zeros(1, rows, 256, dtype=torch.float16)
    w_q, w_s = torch.zeros(64, 128, dtype=torch.uint8), torch.ones(64, 2)
    assert dispatch.quant_linear(x, w_q, w_s, None, None, None, x.dtype, torch.zeros(64, 32, dtype=torch.int32)) \
        == "qg"
    assert calls == [x.shape]
