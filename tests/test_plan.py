"""ssmq plan: the byte arithmetic equals what the model allocates, the fit is right, KV formats cost what their
table says, and the command writes its outputs or stops with one line."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from tiny_ssm import TINY, tiny_model

from ssmq.errors import SSMQError
from ssmq.models import SSMLM, ModelConfig
from ssmq.models.published import PUBLISHED
from ssmq.models.kv_format import kv_format
from ssmq.runtime.plan import (CacheFormat, cache_bytes, fit, float_weight_bytes, kv_bytes_per_token, make_plan,
                               parse_bytes, parse_reserve, state_bytes)

CONFIGS = TINY  # mamba1, mamba2, hybrid, llama
DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def run_cli(capsys, *args):
    """``ssmq plan ARGS`` in this process (as the console script runs it): (exit status, stdout, stderr)."""
    from ssmq.cli import main

    capsys.readouterr()
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


# ---------------------------------------------------------------- arithmetic = allocation

@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("act, state, kv", [("float16", "float16", "fp16"), ("bfloat16", "float32", "bf16"),
                                             ("float32", "float32", "fp32")])
def test_cache_bytes_equal_the_allocated_cache(arch, act, state, kv):
    with torch.device("meta"):
        model = SSMLM(ModelConfig(**CONFIGS[arch]))
    fmt = CacheFormat(act, state, kv_format(kv))
    cache = model.allocate_cache(3, 40, dtype=DTYPE[act], ssm_dtype=DTYPE[state], device="meta")
    assert cache.nbytes() == cache_bytes(model.config, fmt, 3, 40)


def test_int8_state_bytes_equal_the_allocated_int8_cache():
    from ssmq.quant import quantize
    from ssmq.quant.recipe import Cache, Calibration, get_recipe
    from tiny_ssm import synthetic_calibration

    recipe = get_recipe("quamba2-w8a8").with_changes(calibration=Calibration(state_chunk=8), cache=Cache(state_bits=8))
    model = quantize(tiny_model("mamba2"), recipe, synthetic_calibration(64, 4, 32), progress=False)
    cache = model.allocate_cache(2, 16, dtype=torch.bfloat16, ssm_dtype=torch.int8)
    fmt = CacheFormat("bfloat16", "int8", kv_format("fp16"))
    assert cache.nbytes() == cache_bytes(model.config, fmt, 2, 16)
    assert state_bytes(model.config, fmt)["ssm"] * 2 == state_bytes(model.config, CacheFormat(
        "bfloat16", "bfloat16", kv_format("fp16")))["ssm"]
    # dynamic row scales: the codes plus a float32 scale a row, exactly as allocated
    rows = quantize(tiny_model("mamba2"), get_recipe("int8-state"), None, progress=False)
    cache = rows.allocate_cache(2, 16, dtype=torch.bfloat16, ssm_dtype=torch.int8)
    assert cache.nbytes() == cache_bytes(rows.config, CacheFormat("bfloat16", "int8-rows", kv_format("fp16")), 2, 16)


def test_mamba_models_have_no_kv_and_llama_no_state():
    mamba = ModelConfig(**TINY["mamba1"])
    assert kv_bytes_per_token(mamba, kv_format("fp16")) == 0
    fmt = CacheFormat("bfloat16", "bfloat16", kv_format("fp16"))
    plan = make_plan(mamba, "m", fmt, gpu_mem=1 << 30, reserve=0, batch=4, context=1000)
    assert plan.max_context is None  # memory does not grow with the context
    assert plan.max_batch == ((1 << 30) - plan.weights) // sum(state_bytes(mamba, fmt).values())
    llama = ModelConfig(**TINY["llama"])
    assert state_bytes(llama, fmt) == {"conv": 0, "ssm": 0}
    assert kv_bytes_per_token(llama, kv_format("fp16")) == 3 * 2 * 2 * 32 * 2  # layers · K,V · hkv · e · 2 B


def test_published_smollm2_kv_and_weights():
    cfg = PUBLISHED["smollm2-135m"]
    assert kv_bytes_per_token(cfg, kv_format("fp16")) == 30 * 2 * 3 * 64 * 2  # 22.5 KiB per token
    assert float_weight_bytes(cfg, "bfloat16") == 134_515_008 * 2  # tied embedding counted once


def test_weight_bytes_equal_the_model_tensors():
    model = tiny_model("hybrid").to(torch.float16)
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert float_weight_bytes(model.config, "float16") == stored


def test_fit_by_hand():
    # budget 1000 B; 100 B state, 2 B/token per sequence
    assert fit(1000, 100, 2.0, batch=2, context=50) == (200, 5)  # 2·(100 + 200·2) = 1000; 5·(100 + 100) = 1000
    assert fit(1000, 100, 2.0, batch=20, context=50) == (0, 5)  # 20 states alone need 2000 B
    assert fit(1000, 100, 0.0, batch=3, context=10**9) == (None, 10)
    assert fit(-5, 100, 2.0, batch=1, context=1) == (0, 0)  # the weights do not fit


def test_plan_answers_are_tight():
    cfg = ModelConfig(**TINY["hybrid"])
    fmt = CacheFormat("bfloat16", "bfloat16", kv_format("nuq3-1%"))
    plan = make_plan(cfg, "h", fmt, gpu_mem=64 << 20, reserve=8 << 20, batch=3, context=700)
    limit = plan.gpu_mem
    assert plan.memory(3, plan.max_context, cfg) <= limit < plan.memory(3, plan.max_context + 1, cfg)
    assert plan.memory(plan.max_batch, 700, cfg) <= limit < plan.memory(plan.max_batch + 1, 700, cfg)


# ---------------------------------------------------------------- KV formats

def test_kv_format_bytes_by_hand():
    hkv, e = 2, 128  # n = 256 entries a side
    assert kv_format("fp16").bytes_per_token(hkv, e) == 2 * 256 * 2
    # int8 per token-head (kv-int8-pth): 8-bit codes, an fp16 scale + offset per head on each side
    assert kv_format("int8").bytes_per_token(hkv, e) == 2 * (256 * 8 + 32 * hkv) / 8
    # nuq3: 8 levels, 3-bit codes (8 to 3 bytes); per-channel keys (offline scales), per-token values (32 bits a head)
    assert kv_format("nuq3").bytes_per_token(hkv, e) == (256 * 3 + 256 * 3 + 32 * hkv) / 8
    # 1% outliers: round(2.56) = 3 slots for values, twice that for offline per-channel key thresholds; 32 bits each
    assert kv_format("nuq3-1%").bytes_per_token(hkv, e) == (256 * 3 + 256 * 3 + 32 * hkv + 32 * (6 + 3)) / 8
    # 2-bit codes four a byte, 4-bit two; int3 (7 levels, symmetric) and int2 (4 levels) as nuq3 / nuq2
    assert kv_format("nuq2").bytes_per_token(hkv, e) == (256 * 2 + 256 * 2 + 32 * hkv) / 8
    assert kv_format("nuq4").bytes_per_token(hkv, e) == (256 * 4 + 256 * 4 + 32 * hkv) / 8
    assert kv_format("int3").bytes_per_token(hkv, e) == kv_format("nuq3").bytes_per_token(hkv, e)
    # a head dim that is not a multiple of 8: each head's row of 3-bit codes padded to whole bytes (ceil(36 / 8) = 5)
    assert kv_format("nuq3").bytes_per_token(hkv, 12) == 2 * hkv * 5 + 4 * hkv
    assert kv_format("kvquant-nuq3-1%") == kv_format("nuq3-1%").__class__("kvquant-nuq3-1%", **{
        k: getattr(kv_format("nuq3-1%"), k) for k in ("float_bytes", "spec", "description")})


@pytest.mark.parametrize("name", ["kvquant-nuq3-1%", "kvquant-int2", "kv-fp8-e4m3", "kv-int4-pth", "kv-turbo3",
                                  "kvquant-nuq2"])
@pytest.mark.parametrize("e", [64, 12])
def test_kv_format_bytes_equal_the_quantized_cache(name, e):
    # the plan's cost per token is what QuantKVState allocates per token (its sink rows are per sequence)
    from ssmq.models.kv_quantizer import KVQuantizer
    from ssmq.models.quant_kv import QuantKVState

    if name == "kv-turbo3" and e == 12:
        pytest.skip("the rotation needs a power-of-two head dim")
    fmt, hkv, slots, length = kv_format(name), 3, 2, 40
    state = QuantKVState(KVQuantizer(fmt.spec, hkv, e, 0), slots, length, torch.float16, "cpu")
    sink = sum(side.sink.numel() * side.sink.element_size() for side in (state.k, state.v))
    assert state.nbytes() - sink == slots * length * fmt.bytes_per_token(hkv, e)


@pytest.mark.parametrize("name", ["nuq5", "fp16-1%", "int4-100%", "int4-%", "kvquant-nuq9"])
def test_bad_kv_formats(name):
    with pytest.raises(SSMQError, match="unknown KV format"):
        kv_format(name)


def test_sizes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("40960 MiB") == 40 * 2**30 and parse_bytes("1e9") == 10**9
    assert parse_reserve("10%", 1000) == 100 and parse_reserve("1KiB", 10**6) == 1024
    for bad in ("eighty", "80 parsecs", "0", "-1GB"):
        with pytest.raises(SSMQError, match="not a size|must be positive"):
            parse_bytes(bad, "--gpu-mem")
    with pytest.raises(SSMQError, match="percentage"):
        parse_reserve("100%", 1000)


# ---------------------------------------------------------------- the command

def test_plan_command_writes_table_json_and_png(tmp_path, capsys):
    r = run_cli(capsys, "--model", "smollm2-135m", "--gpu-mem", "24GiB", "--context", "8192", "--batch", "16",
                "--kv", "nuq3-1%", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "longest context" in r.stdout and "KV nuq2-1%" in r.stdout
    doc = json.loads((tmp_path / "out" / "plan.json").read_text())
    plan, cfg = doc["plan"], PUBLISHED["smollm2-135m"]
    kv = kv_bytes_per_token(cfg, kv_format("nuq3-1%"))
    budget = 24 * 2**30 - int(24 * 2**30 * 0.1) - float_weight_bytes(cfg, "bfloat16")
    assert plan["kv_per_token"] == kv and plan["budget"] == budget
    assert plan["max_context"] == int(budget / 16 // kv) and plan["max_batch"] == int(budget // (8192 * kv))
    assert f"{plan['max_batch']:,} at context 8,192" in r.stdout
    assert (tmp_path / "out" / "plan.png").stat().st_size > 10_000
    assert [f["kv"] for f in doc["formats"]] == ["nuq3-1%", "bf16", "fp8", "int8", "int4", "nuq4", "nuq4-1%", "nuq2-1%"]


def test_default_kv_is_the_float_cache_of_the_dtype(capsys):
    r = run_cli(capsys, "--model", "smollm2-135m", "--dtype", "float32")
    assert r.returncode == 0 and "45.00 KiB (fp32)" in r.stdout  # 30 layers · K,V · 3 heads · 64 · 4 B


def test_plan_of_a_quantized_folder_uses_stored_bytes_and_the_recipe_state(tmp_path, capsys):
    from safetensors.torch import load_file

    from ssmq.quant import quantize, save_quantized
    from ssmq.quant.recipe import Cache, Calibration, get_recipe
    from tiny_ssm import synthetic_calibration

    recipe = get_recipe("quamba2-w8a8").with_changes(calibration=Calibration(state_chunk=8), cache=Cache(state_bits=8))
    model = quantize(tiny_model("mamba2"), recipe, synthetic_calibration(64, 4, 32), progress=False)
    save_quantized(model, tmp_path / "q")
    r = run_cli(capsys, "--quantized", str(tmp_path / "q"), "--gpu-mem", "1GiB", "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())["plan"]
    stored = sum(t.numel() * t.element_size() for t in load_file(str(tmp_path / "q" / "model.safetensors")).values())
    assert plan["weights"] == stored and "recipe quamba2-w8a8" in plan["weights_source"]
    assert plan["format"]["state_dtype"] == "int8"
    assert plan["state"]["ssm"] == 4 * 256 * 16  # layers · d_inner · d_state, one byte each


@pytest.mark.parametrize("args, message", [
    (["--model", "mamba2-130m", "--gpu-mem", "eighty"], "--gpu-mem 'eighty' is not a size"),
    (["--model", "mamba2-130m", "--kv", "int5"], "unknown KV format 'int5'"),
    (["--model", "mamba2-130m", "--batch", "0"], "--batch and --context must be at least 1"),
    (["--model", "mamba2-130m", "--reserve", "100%"], "percentage must be in"),
    (["--model", "mamba2-130m", "--gpu-mem", "1GiB", "--reserve", "2GiB"], "leaves nothing of --gpu-mem"),
    (["--model", "nosuchname"], "does not exist"),
    (["--quantized", "/nonexistent/q"], "is not a folder"),
])
def test_bad_input_is_one_line_and_nonzero(args, message, capsys):
    r = run_cli(capsys, *args)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ssmq: error:"), r.stderr
    assert any(m in r.stderr for m in message.split("|")), r.stderr


def test_out_that_is_a_file_and_a_float_folder_as_quantized(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    r = run_cli(capsys, "--model", "mamba2-130m", "--out", str(tmp_path / "f"))
    assert r.returncode == 1 and "is a file, not a folder" in r.stderr
    r = run_cli(capsys, "--quantized", str(tmp_path))
    assert r.returncode == 1 and "is not a quantized checkpoint" in r.stderr
