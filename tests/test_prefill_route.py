"""The low-bit linear's pre-selection (``dispatch._candidates``): ``dispatch.quant_linear`` asks only the kernels
whose selection-table rows admit x's dtype and the call's rows, so it must leave out no kernel a table would choose;
at prefill rows of 16-bit x none is left and the call goes straight to quant_gemm's kernels without reading a table.
A table widened in its launch settings widens the candidates."""

from __future__ import annotations

import pytest
import torch

from ssmq.kernels import dispatch
from ssmq.kernels.dispatch import select

pytest.importorskip("triton")

X = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
     "float8_e4m3fn": torch.float8_e4m3fn}
ROWS = (1, 2, 3, 8, 9, 15, 16, 17, 64, 100, 256, 257, 512, 513, 1024, 8192, 1 << 20, (1 << 20) + 1)


def _tables():
    k = dispatch._kernels
    return (dispatch.quant_linear_rows(k("qgemv").CFG), dispatch.packed_linear_rows(k("packed_gemv").CFG),
            dispatch.quant_linear_mid_rows(k("qgemm_mid").CFG), dispatch.quant_linear_a8_rows(k("qgemm_a8").CFG))


@pytest.mark.parametrize("x", sorted(X))
def test_no_kernel_a_table_chooses_is_left_out(x):
    tables = _tables()
    for rows in ROWS:
        maybe = dispatch._candidates(X[x], rows)
        for code in ("int4", "int8", "fp8"):
            for group in (128, None, 4):
                for scaled in (True, False):
                    call = dict(code=code, x=x, rows=rows, zero=False, fits=True, group=group, x_scaled=scaled,
                                n=2560, k=5120)
                    for table in tables:
                        chosen = select(table, call)
                        assert chosen == table[-1].kernel or chosen in maybe, (call, chosen, maybe)


def test_what_the_shipped_tables_leave():
    assert dispatch._candidates(torch.float16, 1024) == set()  # prefill of 16-bit x: straight to quant_gemm
    assert dispatch._candidates(torch.int8, 8192) == {"qgemm_a8"}  # int4 x int8 codes: qgemm_a8 at every row count
    assert "qgemv" in dispatch._candidates(torch.float16, 1)


def test_widened_table_widens_the_candidates(monkeypatch):
    mid = dispatch._kernels("qgemm_mid")
    assert "qgemm_mid" not in dispatch._candidates(torch.float16, 4096)
    monkeypatch.setitem(mid.CFG, "ROUTE", {**mid.CFG["ROUTE"], "int8": [16, 4096]})
    assert "qgemm_mid" in dispatch._candidates(torch.float16, 4096)


def test_prefill_call_skips_the_tables(monkeypatch):
    # on a (pretended) GPU, a 1024-row call of 16-bit x reaches quant_gemm without any table's check running
    calls = []
    monkeypatch.setattr(dispatch, "_use_triton", lambda t: True)
    monkeypatch.setattr(dispatch._kernels("quant_gemm"), "quant_linear", lambda *a: calls.append(a[0].shape) or "qg")

    def refuse(*a, **k):
        raise AssertionError("a selection table was read for a prefill call")

    for name in ("qgemv", "qgemm_mid", "qgemm_a8"):
        monkeypatch.setattr(dispatch._kernels(name), "serves", refuse)
    monkeypatch.setattr(dispatch._kernels("packed_gemv"), "launch", refuse)
    x = torch.zeros(1, 1024, 256, dtype=torch.float16)
    w_q, w_s = torch.zeros(64, 128, dtype=torch.uint8), torch.ones(64, 2)
    assert dispatch.quant_linear(x, w_q, w_s, None, None, None, x.dtype, torch.zeros(64, 32, dtype=torch.int32)) \
        == "qg"
    assert calls == [x.shape]
