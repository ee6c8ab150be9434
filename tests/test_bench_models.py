"""The benchmarks' random models: a linears-only recipe applied part by part as the model is made equals making the
float model whole and quantizing it, and never holds two parts' float linears at once."""

from __future__ import annotations

import pytest
import torch

from tiny_ssm import TINY

from ssmq.bench import models as bench_models
from ssmq.bench.models import build, random_model
from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig
from ssmq.quant import get_recipe, quantize
from ssmq.quant.api import linears_only, plan, quantize_linears_under
from ssmq.quant.linear import QuantLinear

CONFIGS = {  # a MoE hybrid (Jamba-like) and Mamba-2 blocks sharing one transformer block (Zamba2-like)
    "moe": ModelConfig(**{**TINY["hybrid"], "mlp_hidden": 128, "moe_layer_idx": (0, 2), "moe_experts": 4,
                          "moe_top_k": 2, "moe_hidden": 128}),
    "shared": ModelConfig(**{**TINY["mamba2"], "shared_attn_layer_idx": (1, 3), "shared_blocks": 1, "attn_heads": 4,
                             "attn_kv_heads": 4, "attn_head_dim": 32, "mlp_hidden": 128}),
}


@pytest.mark.parametrize("recipe", ["rtn-w4a16-g128", "fp8-w8a8"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_part_by_part_equals_whole_then_quantized(arch, recipe):
    cfg = CONFIGS[arch]
    streamed, vocab = build(cfg, recipe, torch.device("cpu"), torch.float32)
    whole = quantize(random_model(cfg, torch.device("cpu"), torch.float32), get_recipe(recipe), progress=False)
    a, b = streamed.state_dict(), whole.state_dict()
    assert a.keys() == b.keys() and vocab == cfg.vocab_size
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    assert streamed.quantization == whole.quantization
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(streamed(ids), whole(ids))


def test_no_two_parts_float_linears_are_alive_at_once(monkeypatch):
    """When a part is quantized, every other target linear is either not made yet (meta) or already quantized."""
    cfg, recipe = CONFIGS["moe"], get_recipe("rtn-w4a16-g128")
    seen = []

    def checked(model, rec, prefix):
        for path in plan(rec, model):
            if path == prefix or path.startswith(prefix + "."):
                continue
            m = model.get_submodule(path)
            assert isinstance(m, QuantLinear) or m.weight.is_meta, f"{path} is float and made while {prefix} is"
        seen.append(prefix)
        quantize_linears_under(model, rec, prefix)

    monkeypatch.setattr("ssmq.quant.api.quantize_linears_under", checked)
    bench_models.random_model(cfg, torch.device("cpu"), torch.float32, recipe=recipe)
    assert seen == ["embedding"] + [f"layers.{i}" for i in range(cfg.n_layer)] + ["norm_f", "lm_head"]


def test_only_linears_only_recipes_go_part_by_part():
    assert linears_only("rtn-w4a16-g128") and linears_only("fp8-w8a8")
    assert not linears_only("quamba2-w4a8") and not linears_only("int8-state")
    with pytest.raises(SSMQError, match="does more than quantize linears"):
        quantize_linears_under(random_model(CONFIGS["moe"], torch.device("cpu"), torch.float32),
                               "quamba2-w4a8", "layers.0")
