"""The decode GEMV on repacked codes (``ssmq.kernels.packed_gemv``): the layout (``ops.quant_linear.pack_words``)
round-trips exactly and its reference is the stored weight's function; the kernel equals the reference within fp16 /
bf16 rounding of the float64 result for every format, row count and K split; the selection table routes to it only
where ROUTE_ROWS says, and ``QuantLinear.bind_decode`` makes the copy only where a call would use it. Kernel tests
are ``gpu`` (``SSMQ_TRITON_INTERPRET=1`` runs a smaller sweep on CPU); the layout and table tests run anywhere.
"""

from __future__ import annotations

import pytest
import torch

from ssmq import ops
from ssmq.errors import SSMQError
from ssmq.kernels.dispatch import packed_linear_rows, select
from ssmq.ops.quant_linear import pack_int4, pack_words, unpack_words, words_linear_ref
from test_kernels import DEV, INTERPRET, kernel_module, rel


def _codes(n, k, bits, device="cpu"):
    lim = 1 << (bits - 1)
    return torch.randint(-lim, lim, (n, k), dtype=torch.int8, device=device)


@pytest.mark.parametrize("bits,k", [(4, 128), (4, 640), (8, 64), (8, 320)])
def test_pack_words_round_trips(bits, k):
    torch.manual_seed(k)
    q = _codes(7, k, bits)
    words = pack_words(q, bits)
    assert words.dtype == torch.int32 and words.shape == (7, k * bits // 32)
    assert torch.equal(unpack_words(words, bits), q)
    # every code value at every slot: the extremes survive the sign of the top slot
    lim = 1 << (bits - 1)
    q = torch.arange(-lim, lim, dtype=torch.int8).repeat(k // (2 * lim) + 1)[:k].reshape(1, k).repeat(3, 1)
    assert torch.equal(unpack_words(pack_words(q, bits), bits), q)


def test_pack_words_layout():
    # code c of a 128-code int4 block: word c % 16, slot c // 16, offset binary
    q = torch.zeros(1, 128, dtype=torch.int8)
    q[0, 16 * 3 + 5] = -8 + 11  # slot 3 of word 5 holds 11
    w = pack_words(q, 4)[0].long() & 0xFFFFFFFF
    zero = 0x88888888  # every other code 0 -> offset binary 8
    assert int(w[5]) == (zero & ~(0xF << 12)) | (11 << 12)
    assert all(int(v) == zero for i, v in enumerate(w.tolist()) if i != 5)
    q8 = torch.zeros(1, 64, dtype=torch.int8)
    q8[0, 16 * 2 + 1] = -128  # int8 block of 64: slot 2 of word 1 holds 0
    w8 = pack_words(q8, 8)[0].long() & 0xFFFFFFFF
    assert int(w8[1]) == 0x80008080 and int(w8[0]) == 0x80808080


def test_pack_words_refuses_partial_blocks():
    with pytest.raises(SSMQError, match="multiple of 128"):
        pack_words(_codes(2, 96, 4), 4)
    with pytest.raises(SSMQError, match="int4 or int8"):
        pack_words(_codes(2, 128, 4), 3)


@pytest.mark.parametrize("bits,group", [(4, 128), (4, None), (8, None), (8, 64)])
def test_words_reference_is_the_stored_weights_function(bits, group):
    torch.manual_seed(1)
    n, k = 24, 256
    q = _codes(n, k, bits)
    s = torch.rand((n, k // group) if group else (n,)) * 0.01 + 1e-3
    x, b = torch.randn(3, k), torch.randn(n)
    stored = pack_int4(q) if bits == 4 else q
    assert torch.equal(words_linear_ref(x, pack_words(q, bits), bits, s, b), ops.quant_linear_ref(x, stored, s, None,
                                                                                                  None, b))


def test_table_routes_by_rows_code_and_dtype():
    cfg = {"ROUTE_ROWS": {"int4": 4, "int8": 1}, "MAX_ROWS": 8}
    table = packed_linear_rows(cfg)
    launch = dict(code="int4", x="float16", rows=1, fits=True)
    assert select(table, launch) == "packed_gemv"
    assert select(table, {**launch, "rows": 4, "x": "bfloat16"}) == "packed_gemv"
    assert select(table, {**launch, "rows": 5}) == "stored"
    assert select(table, {**launch, "x": "float32"}) == "stored"
    assert select(table, {**launch, "fits": False}) == "stored"
    assert select(table, {**launch, "code": "int8", "rows": 2}) == "stored"
    assert select(table, {**launch, "code": "int8"}) == "packed_gemv"
    assert select(packed_linear_rows({"ROUTE_ROWS": {"int4": 0, "int8": 0}, "MAX_ROWS": 8}), launch) == "stored"


def test_bind_decode_on_cpu_keeps_the_stored_layout():
    # no copy on the CPU (the references read the stored codes); the copy is never part of the state dict
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import WeightSpec

    lin = torch.nn.Linear(256, 16)
    m = QuantLinear.from_float(lin, WeightSpec.from_dict({"dtype": "int4", "granularity": "per_group:128"}))
    m.bind_decode()
    assert m.weight_words is None and "weight_words" not in m.state_dict()


def test_bind_decode_of_codes_made_under_inference_mode():
    # a model built and quantized under torch.inference_mode (ssmq bench) holds inference tensors, which keep no
    # version counter: decode set-up must still bind them
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import WeightSpec

    with torch.inference_mode():
        m = QuantLinear.from_float(torch.nn.Linear(256, 16),
                                   WeightSpec.from_dict({"dtype": "int4", "granularity": "per_group:128"}))
        assert m.weight_q.is_inference()
        m.bind_decode()
    assert m.weight_words is None


# ------------------------------------------------------------------------------------------------- the kernel
@pytest.fixture(scope="module")
def PG():
    return kernel_module("packed_gemv")


FMTS = [(4, 128), (4, 256), (4, None), (4, "tensor"), (8, None), (8, 64)]
SPLITS = {"in_kernel": {"MAX_ITERS": 1}, "epilogue": {"MAX_ITERS": 1, "SPLIT_IN_KERNEL": False},
          "loop": {"MAX_SPLIT": 1}}


def _weight(n, k, fmt):
    bits, group = fmt
    q = _codes(n, k, bits, DEV)
    if group == "tensor":
        s = torch.tensor(0.01, device=DEV)
    else:
        s = torch.rand((n, k // group) if group else (n,), device=DEV) * 0.01 + 1e-3
    return bits, q, s


def _check(PG, fmt, rows, cfg, dtype, n, k):
    bits, q, s = _weight(n, k, fmt)
    words = pack_words(q, bits)
    x = torch.randn(rows, k, device=DEV).to(dtype)
    bias = torch.randn(n, device=DEV).to(dtype)
    out = PG.packed_gemv(x, words, s, bits, bias, cfg=cfg)
    exact = words_linear_ref(x.double(), words, bits, s, bias.double())
    eps = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert out.dtype == dtype and out.shape == (rows, n) and torch.isfinite(out).all()
    assert rel(out, exact) <= rel(words_linear_ref(x, words, bits, s, bias), exact) + eps


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_equals_reference(PG, fmt, rows):
    if INTERPRET and (rows == 2 or fmt[1] == "tensor"):
        pytest.skip("a smaller sweep under the interpreter")
    torch.manual_seed(rows)
    n, k = (40, 1024) if INTERPRET else (200, 2048)
    _check(PG, fmt, rows, PG.CFG, torch.float16, n, k)
    if fmt == (4, 128) and not INTERPRET:  # the interpreter computes through numpy, which has no bfloat16
        _check(PG, fmt, rows, PG.CFG, torch.bfloat16, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("fmt", [(4, 128), (8, None)])
def test_k_splits(PG, fmt, rows, split):
    # the K split summed in the kernel, by the epilogue kernel, or no split (one program loops over k)
    torch.manual_seed(rows)
    n, k = (40, 1024) if INTERPRET else (200, 2048)
    cfg = {**PG.CFG, **SPLITS[split]}
    plan = PG._plan(rows, n, k, fmt[0], fmt[1], 132, cfg)
    assert (plan["split"] > 1) == (split != "loop") and (plan["iters"] > 1) == (split == "loop")
    _check(PG, fmt, rows, cfg, torch.float16, n, k)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="Mamba2-2.7B's shapes: GPU only")
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("n,k,fmt", [(10576, 2560, (4, 128)), (2560, 5120, (4, 128)), (10576, 2560, (8, None))])
def test_model_shapes(PG, n, k, fmt, rows):
    torch.manual_seed(n + rows)
    bits, q, s = _weight(n, k, fmt)
    words = PG.pack(pack_int4(q) if bits == 4 else q)
    assert torch.equal(words, pack_words(q, bits))  # pack on the GPU = the reference layout
    x = torch.randn(2, rows, k, device=DEV, dtype=torch.float16)[1]  # rows of a larger tensor
    out = PG.packed_gemv(x, words, s, bits)
    exact = words_linear_ref(x.double(), words, bits, s)
    assert rel(out, exact) <= rel(words_linear_ref(x, words, bits, s), exact) + 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and the module path: GPU only")
def test_quant_linear_routes_bound_words_and_graphs_replay(PG, monkeypatch):
    # with ROUTE_ROWS routing every row, QuantLinear.bind_decode makes the copy and the module's forward runs on it
    # (the same values as the stored layout's kernels, within rounding); a CUDA-graph replay equals the eager call
    from ssmq.quant.linear import QuantLinear
    from ssmq.quant.spec import WeightSpec

    from ssmq.kernels import policy

    monkeypatch.setitem(PG.CFG, "ROUTE_ROWS", {"int4": 8, "int8": 8})
    lin = torch.nn.Linear(2560, 4096, device=DEV, dtype=torch.float16)
    m = QuantLinear.from_float(lin, WeightSpec.from_dict({"dtype": "int4", "granularity": "per_group:128"}))
    assert m.weight_words is None
    m.bind_decode()  # the default policy holds no second copy of the codes
    assert m.weight_words is None
    monkeypatch.setattr(policy, "_ACTIVE", [policy.KernelPolicy(repacked_decode=True)])
    m.bind_decode()
    assert m.weight_words is not None and torch.equal(unpack_words(m.weight_words, 4), m.weight_codes())
    x = torch.randn(3, 2560, device=DEV, dtype=torch.float16)
    calls = []
    real = PG.packed_gemv
    monkeypatch.setattr(PG, "packed_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = m(x)
    assert calls, "the bound words were not used"
    exact = ops.quant_linear_ref(x.double(), m.weight_q, m.weight_scale, None, None, m.bias.double())
    assert rel(out, exact) < 3e-3
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = m(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, out)
    monkeypatch.setitem(PG.CFG, "ROUTE_ROWS", {"int4": 0, "int8": 0})
    m.weight_words = None
    m.bind_decode()  # nothing routed: no copy
    assert m.weight_words is None
