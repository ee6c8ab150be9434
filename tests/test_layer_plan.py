"""What runs is decided once: the kernel policy (no environment read below the runtime), the selection tables of the
dispatch, each layer's decode plan (chosen when its state is allocated), and the formats a quantized model owns
(``model.allocate_cache()`` / ``CudaGraphDecoder(model, ...)`` with default arguments)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ssmq.errors import SSMQError
from ssmq.kernels import dispatch
from ssmq.kernels.dispatch import FLOAT_KV_DECODE, LINEAR, QUANT_KV_DECODE, float_kv_launch, quant_kv_launch, select
from ssmq.kernels.policy import KernelPolicy, active, using
from ssmq.models.quant_kv import QuantKVState
from ssmq.runtime.kernel_policy import policy_from_env
from test_int8_decode import IDS, SLOTS, quantized

ROOT = Path(__file__).resolve().parent.parent


def test_no_environment_read_in_kernels_or_models():
    files = [p for folder in ("kernels", "models") for p in (ROOT / "ssmq" / folder).rglob("*.py")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"os\.environ|getenv", line)]
    assert hits == []


# ------------------------------------------------------------------------------------------------ the policy
def test_policy_from_env():
    assert policy_from_env({}) == KernelPolicy()
    p = policy_from_env({"SSMQ_REF_OPS": "1", "SSMQ_PDL": "0", "SSMQ_KV_WARP": "0", "SSMQ_FUSED_ACT_QUANT": "0"})
    assert p.reference_ops and not p.pdl and not p.act_quant_fusion and p.kv_decode == ("kv_decode_fast", "kv_decode")
    assert policy_from_env({"SSMQ_KV_FAST": "0"}).kv_decode == ("kv_decode",)
    assert "pdl=False" in p.describe() and KernelPolicy().describe() == ""
    with pytest.raises(SSMQError, match="SSMQ_PDL='yes': expected 0 or 1"):
        policy_from_env({"SSMQ_PDL": "yes"})


def test_using_restores_the_policy():
    before = active()
    with using(KernelPolicy(reference_ops=True)):
        assert active().reference_ops
        assert not dispatch._use_triton(torch.zeros(1))
    assert active() is before


# ------------------------------------------------------------------------------------------- selection tables
def _quant(bits=4, full=True, key_per_token=False, head_dim=128, rotary_dim=128, sink=1, group=4, block=0):
    return quant_kv_launch(bits, bits, full, key_per_token, True, head_dim, rotary_dim, sink, group, block)


@pytest.mark.parametrize("launch,kernel", [
    (_quant(), "kv_decode_warp"),                           # KVQuant nuq4: per-channel keys, per-token values
    (_quant(bits=3, head_dim=64, rotary_dim=32, group=3), "kv_decode_warp"),  # the hybrid's heads
    (_quant(full=False), "kv_decode_fast"),                 # 15-level codebooks: the warp kernel reads 16
    (_quant(key_per_token=True), "kv_decode_fast"),         # the engines' per-token keys
    (_quant(group=16), "kv_decode_fast"),                   # more query heads than the 8 columns
    (_quant(block=8), "kv_decode_fast"),                    # paged blocks of half a tile
    (_quant(head_dim=64, rotary_dim=128), "kv_decode_fast"),  # a rotary dim past the head
    (_quant(rotary_dim=24), "kv_decode"),                   # rotary halves not whole bytes of codes
    (_quant(bits=8), "kv_decode"),
])
def test_quant_kv_decode_table(launch, kernel):
    assert select(QUANT_KV_DECODE, launch, gluon=True) == kernel


def test_the_policy_and_gluon_narrow_the_kv_table():
    launch = _quant()
    assert select(QUANT_KV_DECODE, launch, gluon=False) == "kv_decode_fast"
    assert select(QUANT_KV_DECODE, launch, KernelPolicy(kv_decode=("kv_decode_fast",)), gluon=True) == "kv_decode_fast"
    assert select(QUANT_KV_DECODE, launch, KernelPolicy(kv_decode=()), gluon=True) == "kv_decode"


def test_float_kv_and_linear_tables():
    assert select(FLOAT_KV_DECODE, float_kv_launch(torch.float16, 128)) == "kv_decode_fast"
    assert select(FLOAT_KV_DECODE, float_kv_launch(torch.bfloat16, 16)) == "kv_decode"  # narrower than 32
    assert select(FLOAT_KV_DECODE, float_kv_launch(torch.float32, 128)) == "kv_decode"  # float32-exact products
    assert select(FLOAT_KV_DECODE, float_kv_launch(torch.float16, 96)) == "kv_decode"
    row = dict(dtype="float16", same_dtype=True)
    assert select(LINEAR, row | dict(rows=8)) == "gemv" and select(LINEAR, row | dict(rows=9)) == "torch"
    assert select(LINEAR, row | dict(rows=1, same_dtype=False)) == "torch"
    q = torch.zeros(1, 4, 2, 64, dtype=torch.float16)
    assert select(dispatch.PREFILL_ATTENTION, dispatch.prefill_launch(q, q, q)) == "attention_prefill"
    assert select(dispatch.PREFILL_ATTENTION, dispatch.prefill_launch(q.float(), q, q)) == "reference"
    assert select(dispatch.PREFILL_ATTENTION, dispatch.prefill_launch(q.transpose(2, 3), q, q)) == "reference"


def test_quant_linear_table_reads_its_rows_from_the_config():
    """qgemv's rows of the low-bit linear table: the rows ROUTE_ROWS (qgemv.json) gives each code type, the formats
    it serves; every other call goes to quant_gemm."""
    rows = dispatch.quant_linear_rows(dict(MAX_ROWS=8, ROUTE_ROWS=dict(int4=0, int8=1, fp8=2)))
    call = dict(code="int8", x="float16", rows=1, group=None, zero=False, x_scaled=False, fits=True)
    assert select(rows, call) == "qgemv"
    assert select(rows, call | dict(rows=2)) == "quant_gemm"  # past int8's ROUTE_ROWS
    assert select(rows, call | dict(code="int4", group=128)) == "quant_gemm"  # int4 routes no row
    assert select(rows, call | dict(code="fp8", x="float8_e4m3fn", rows=2, x_scaled=True)) == "qgemv"
    assert select(rows, call | dict(code="fp8", x="float8_e4m3fn")) == "quant_gemm"  # fp8 x without its scale
    assert select(rows, call | dict(x="float8_e4m3fn", x_scaled=True)) == "quant_gemm"  # fp8 x on int8 codes
    assert select(rows, call | dict(zero=True)) == "quant_gemm"
    assert select(rows, call | dict(fits=False)) == "quant_gemm"
    assert select(rows, call | dict(group=48)) == "quant_gemm"  # groups are powers of two
    everything = dispatch.quant_linear_rows(dict(MAX_ROWS=8, ROUTE_ROWS=dict(int4=8, int8=8, fp8=8)))
    assert select(everything, call | dict(code="int4", group=128, rows=8)) == "qgemv"
    assert select(everything, call | dict(code="int4", group=4)) == "quant_gemm"  # 2 bytes of int4 codes a group
    assert select(everything, call | dict(group=4)) == "qgemv"
    assert select(everything, call | dict(rows=9)) == "quant_gemm"


# ------------------------------------------------------------------------------------------------ layer plans
def test_float_models_plan_the_fused_or_float_step():
    from tiny_ssm import tiny_model

    cache = tiny_model("mamba2").allocate_cache(2, 8)
    assert {st.plan.executor for st in cache.states} == {"fused"}
    cache = tiny_model("mamba1").allocate_cache(2, 8)
    assert {st.plan.executor for st in cache.states} == {"float"}
    cache = tiny_model("mamba2").allocate_cache(2, 8, state_checkpoint=4)  # the ring steps through step_ssm
    assert {st.plan.kernels[1] for st in cache.states} == {"replay_state_update"}


@pytest.mark.parametrize("paged", [False, True])
def test_a_float_cache_decodes_through_the_kernel_its_plan_chose(paged, monkeypatch):
    """A float KV cache's decode executor is chosen when the cache is allocated (``plan.decode``: the kernel bound),
    so a decode step selects nothing: with the selection tables made to fail after allocation the model still
    decodes, through the plan's kernel (the reference on CPU), to the logits of the reference path; a cache no
    kernel takes (float32 on CPU) has no executor."""
    from tiny_ssm import tiny_model

    import ssmq.models.state as state

    model = tiny_model("hybrid", seed=3)
    assert model.allocate_cache(2, 16).states[1].plan.decode is None  # CPU: the rows read out for attention_ref
    monkeypatch.setattr(state, "kernel_decodes", lambda k, rope, cuda=None: rope is None)  # as on CUDA
    kw = dict(kv_blocks=16, kv_block_size=4) if paged else {}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(cache):
        if paged:
            for s in range(2):
                cache.block_table.assign(s, 0, list(range(1 + 4 * s, 5 + 4 * s)))
        with torch.no_grad():
            return torch.stack([model(ids[:, :4], cache)[:, -1]] + [model.step(ids[:, t], cache) for t in range(4, 9)])

    cache = model.allocate_cache(2, 16, **kw)
    plan = cache.states[1].plan
    assert plan.executor == "kv-float" and plan.decode.keywords == {"kernel": "kv_decode"}  # head dim 16
    monkeypatch.setattr(dispatch, "select", lambda *a, **kw: pytest.fail("a decode step selected a kernel"))
    got = run(cache)
    monkeypatch.undo()
    ref = run(model.allocate_cache(2, 16, **kw))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
def test_a_quamba2_int8_state_model_plans_the_int8_step(arch):
    model = quantized(arch, "quamba2-w8a8", 8)
    cache = model.allocate_cache(4, 32)
    plans = [st.plan for st in cache.states]
    assert {p.executor for p in plans} == {"int8"}
    assert all(p.kernels[:2] == ("conv1d_update_silu_quant", "quant_state_update") for p in plans)
    assert all(p.formats["state"].startswith("int8") for p in plans)
    assert model.layers[0].mixer.plan(cache.states[0], "float").executor == "float"  # asked for explicitly
    if arch == "mamba2":
        with pytest.raises(SSMQError, match="fused decode serves a float state"):
            model.layers[0].mixer.plan(cache.states[0], "fused")


# ------------------------------------------------------------------------------- the model owns its formats
@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
def test_an_int8_state_model_decodes_on_its_int8_state_by_default(arch):
    """``model.allocate_cache()`` without ssm_dtype: the int8 state, and decoding on it equals decoding on the cache
    asked for explicitly, bit for bit; a float state is there when asked for."""
    model = quantized(arch, "quamba2-w8a8", 8)

    def run(cache):
        with torch.no_grad():
            out = [model(IDS[:, :12], cache, SLOTS)[:, -1]]
            out += [model.step(IDS[:, t], cache, SLOTS) for t in range(12, 16)]
        return torch.stack(out, 1)

    default, explicit = model.allocate_cache(4, 32), model.allocate_cache(4, 32, ssm_dtype=torch.int8)
    assert all(s.dtype == torch.int8 for s in default.ssm_states)
    assert torch.equal(run(default), run(explicit))
    assert all(s.dtype == torch.float32 for s in model.allocate_cache(4, 32, ssm_dtype=torch.float32).ssm_states)


def _kv_model():
    from _quant_tiny import tiny_calib, tiny_model

    from ssmq.quant import quantize

    m = tiny_model("hybrid")
    quantize(m, "kvquant-nuq3-1%", tiny_calib(4, 32), progress=False)
    return m


def test_a_kvquant_model_decodes_on_its_quantized_cache_by_default():
    m = _kv_model()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    cache = m.allocate_cache(2, 12)
    assert isinstance(cache.states[1], QuantKVState)
    plan = cache.states[1].plan
    # head dim 16: only the first kernel serves it
    assert plan.executor == "kv-quant" and plan.kernels == ("kv_decode",) and "nuq3" in plan.formats["kv"]
    with torch.no_grad():
        full = m(ids)
        steps = [m(ids[:, :4], cache)] + [m.step(ids[:, t], cache)[:, None] for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("which", ["int8", "kv"])
def test_the_cuda_graph_decoder_allocates_the_models_formats(which, monkeypatch):
    """``CudaGraphDecoder(model, ...)`` with default arguments allocates the cache the model owns (checked without a
    GPU: the decoder's cache is made before any graph is captured)."""
    from ssmq.models.lm import SSMLM
    from ssmq.runtime import cuda_graph

    model = quantized("mamba2", "quamba2-w8a8", 8) if which == "int8" else _kv_model()
    monkeypatch.setattr(SSMLM, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(cuda_graph.torch.cuda, "graph_pool_handle", lambda: None)
    dec = cuda_graph.CudaGraphDecoder(model, max_batch=2, max_seqlen=16)
    if which == "int8":
        assert all(s.dtype == torch.int8 for s in dec.cache.ssm_states)
        assert {st.plan.executor for st in dec.cache.states} == {"int8"}
    else:
        assert isinstance(dec.cache.states[1], QuantKVState)


def test_plan_lines_of_an_int8_state_model():
    from ssmq.runtime.layer_plans import plan_lines

    model = quantized("mamba2", "quamba2-w8a8", 8)
    lines = plan_lines(model, torch.float16)
    assert lines[0].startswith("kernel policy: default") and len(lines) == 1 + model.config.n_layer
    assert all(" int8 " in line and "quant_state_update" in line and "state int8" in line for line in lines[1:])


def test_info_prints_the_plan(capsys):
    from conftest import shared_or_skip

    from ssmq.cli import main

    assert main(["info", "--model", str(shared_or_skip("models", "hybrid")), "--plan", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "layer   0 mamba2    fused" in out and "layer   3 attention kv-float kv_decode_fast" in out
