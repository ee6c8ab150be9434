"""The serving-batch weight-only linear's selection table (``dispatch.quant_linear_mid_rows``): qgemm_mid for the
rows its ROUTE gives each code type, 16-bit x, symmetric codes and a layout it fits; quant_gemm otherwise. Also that
the shipped ROUTE names only code types the kernel serves."""

from __future__ import annotations

import json

from ssmq.kernels import configs, dispatch
from ssmq.kernels.dispatch import select


def test_table_reads_its_rows_from_the_config():
    rows = dispatch.quant_linear_mid_rows(dict(ROUTE=dict(int4=[17, 64], int8=[16, 256])))
    call = dict(code="int4", x="float16", rows=32, n=64, k=256, zero=False, fits=True)
    assert select(rows, call) == "qgemm_mid"
    assert select(rows, call | dict(x="bfloat16", rows=17)) == "qgemm_mid"
    assert select(rows, call | dict(rows=16)) == "quant_gemm"  # below int4's range
    assert select(rows, call | dict(rows=65)) == "quant_gemm"
    assert select(rows, call | dict(code="int8", rows=256)) == "qgemm_mid"
    assert select(rows, call | dict(code="fp8")) == "quant_gemm"
    assert select(rows, call | dict(x="float32")) == "quant_gemm"
    assert select(rows, call | dict(zero=True)) == "quant_gemm"
    assert select(rows, call | dict(fits=False)) == "quant_gemm"
    none = dispatch.quant_linear_mid_rows(dict(ROUTE=dict(int4=[1, 0])))
    assert select(none, call | dict(rows=1)) == "quant_gemm"


def test_shape_exceptions_keep_quant_gemm():
    # an EXCEPT entry sends its code type, weight shape and rows to quant_gemm; other shapes and rows keep the route
    cfg = dict(ROUTE=dict(int4=[16, 256], int8=[16, 256]), EXCEPT=[dict(code="int4", n=2560, k=5120, rows=[65, 256])])
    rows = dispatch.quant_linear_mid_rows(cfg)
    call = dict(code="int4", x="float16", rows=128, n=2560, k=5120, zero=False, fits=True)
    assert select(rows, call) == "quant_gemm"
    assert select(rows, call | dict(rows=64)) == "qgemm_mid"
    assert select(rows, call | dict(n=10576, k=2560)) == "qgemm_mid"
    assert select(rows, call | dict(k=2560)) == "qgemm_mid"
    assert select(rows, call | dict(code="int8")) == "qgemm_mid"


def test_shipped_route():
    data = json.loads(configs.path("qgemm_mid").read_text())
    for settings in data["devices"].values():
        assert set(settings["ROUTE"]) <= {"int4", "int8"}
        assert all(e["code"] in settings["ROUTE"] and e["rows"][0] <= e["rows"][1] for e in settings.get("EXCEPT", ()))
        for key in ("ROWS_W4", "ROWS_W8"):
            assert [e["max_rows"] for e in settings[key]] == sorted(e["max_rows"] for e in settings[key])
            assert all(e["BK"] & (e["BK"] - 1) == 0 and e["BM"] >= 16 for e in settings[key])
