"""Llama as the degenerate hybrid (every layer attention, full RoPE, GQA, SwiGLU): ssmq equals transformers'
LlamaForCausalLM on tiny random checkpoints, tied and untied; the cache, greedy generation, bad configs, export
names. (Logits, prefill-then-decode and cache reset of the tied model are in test_models.py with the other
families.)"""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import save_tiny

import ssmq
from ssmq.errors import SSMQError
from ssmq.models import ModelConfig
from ssmq.models.hf_layout import config_to_hf, rename_to_hf
from ssmq.models.loading import config_from_hf, rename_to_ssmq
from ssmq.ops.layout import LayerKind
from ssmq.runtime.generate import generate
from ssmq.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_untied")
    return folder, save_tiny("llama", folder, seed=3, tie=False)


def test_untied_logits_match_transformers(untied):
    folder, hf = untied
    model = ssmq.load_model(folder)
    cfg = model.config
    assert cfg.arch == "llama" and not cfg.tie_embeddings
    assert [cfg.layer_kind(i) for i in range(cfg.n_layer)] == [LayerKind.ATTENTION] * 3
    assert cfg.rotary_dim == cfg.attn_head_dim == 8 and (cfg.attn_heads, cfg.attn_kv_heads) == (4, 2)
    assert model.lm_head.weight.data_ptr() != model.embedding.weight.data_ptr()
    ids = torch.randint(0, 96, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ref.abs().max() > 1.0
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("keys_before_rope", [False, True])
def test_decode_with_cache_equals_full_forward(untied, keys_before_rope):
    # keys_before_rope: the pre-RoPE cache (KVQuant) rotates all of each head (full RoPE) at read
    model = ssmq.load_model(untied[0])
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids)
        cache = model.allocate_cache(3, 24, kv_keys_before_rope=keys_before_rope)
        slots = torch.tensor([2, 0])
        pieces = [model(ids[:, :10], cache, slots)]
        pieces += [model.step(ids[:, t], cache, slots).unsqueeze(1) for t in range(10, 17)]
    assert cache.states[0].keys_before_rope is keys_before_rope
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)


def test_greedy_generation_equals_transformers(untied):
    folder, hf = untied
    model = ssmq.load_model(folder)
    prompts = [[5, 17, 33, 2], [40, 41]]
    out = generate(model, prompts, SamplingParams(max_new_tokens=12, stop_at_eos=False))
    for prompt, ours in zip(prompts, out):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref
    assert len(set(out[0])) > 1  # not a degenerate constant sequence


def test_safetensors_config_round_trips_through_the_export_layout(untied):
    # ssmq export writes LlamaForCausalLM names and config; loading them back gives the same model
    folder, hf = untied
    model = ssmq.load_model(folder)
    cfg = model.config
    hf_names = set(hf.state_dict())
    for name in dict(model.named_parameters()):
        assert rename_to_hf(name, cfg) in hf_names
        assert rename_to_ssmq(rename_to_hf(name, cfg)) == name
    written = config_to_hf(cfg)
    assert written["architectures"] == ["LlamaForCausalLM"]
    assert config_from_hf(written) == cfg


# ---------------------------------------------------------------- bad input

def _config(**changes) -> dict:
    c = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48}
    return {**c, **changes}


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "RoPE type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_unsupported_llama_variants_are_refused(tmp_path, changes, message):
    (tmp_path / "config.json").write_text(json.dumps(_config(**changes)))
    with pytest.raises(SSMQError, match=message):
        ssmq.load_model(tmp_path)


def test_llama_config_defaults_and_checks():
    cfg = config_from_hf(_config(num_key_value_heads=None))  # absent KV heads: multi-head attention
    assert cfg.attn_kv_heads == 4 and cfg.attn_head_dim == 8 and cfg.rotary_dim == 8 and not cfg.tie_embeddings
    assert cfg.attention_layers() == [0, 1] and cfg.ssm_layers() == [] and cfg.has_mlp
    with pytest.raises(ValueError, match="attention in every layer"):
        ModelConfig(arch="llama", d_model=32, n_layer=2, vocab_size=8, attn_layer_idx=(1,), attn_heads=4,
                    attn_kv_heads=2, attn_head_dim=8)
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        ModelConfig(arch="llama", d_model=32, n_layer=2, vocab_size=8, attn_heads=4, attn_kv_heads=3,
                    attn_head_dim=8)


def test_missing_llama_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny("llama", tmp_path, tie=False)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.post_attention_layernorm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(SSMQError, match=r"missing tensors \['layers.1.mlp_norm.weight'\]"):
        ssmq.load_model(tmp_path)


# ---------------------------------------------------------------- quantization recipes

def _quantized_llama(recipe):
    """A 2-layer random llama (weights N(0, 0.02)) and its logits (b, l, vocab) before and after ``recipe``."""
    from tiny_ssm import synthetic_calibration

    from ssmq.quant import quantize

    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", d_model=128, n_layer=2, vocab_size=64, attn_heads=4, attn_kv_heads=2,
                      attn_head_dim=32, rotary_dim=32, mlp_hidden=256, tie_embeddings=False)
    model = ssmq.models.SSMLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    calib = synthetic_calibration(64, 4, 32)
    ids = calib.input_ids[:2]
    with torch.no_grad():
        ref = model(ids)
        quantized = quantize(model, recipe, calib, progress=False)
        return quantized, ids, ref, quantized(ids)


# measured relative logit errors on this model: 0.010, 0.019, 0.013 (8-bit), 0.170 (RTN int4), 0.072 (GPTQ int4);
# the same as the hybrid's at the same sizes
@pytest.mark.parametrize("recipe, bound", [("rtn-w8a16", 0.03), ("smoothquant-w8a8", 0.05), ("hadamard-w8a8", 0.03),
                                           ("rtn-w4a16-g128", 0.3), ("gptq-w4a16-g128", 0.12)])
def test_linear_recipes_quantize_llama_and_round_trip(recipe, bound, tmp_path):
    from ssmq.quant import save_quantized

    quantized, ids, ref, out = _quantized_llama(recipe)
    assert 0 < (out - ref).norm() / ref.norm() < bound
    save_quantized(quantized, tmp_path / "q")
    with torch.no_grad():
        assert torch.equal(ssmq.load_model(tmp_path / "q")(ids), out)


def test_ssm_recipes_refuse_llama():
    from ssmq.quant import quantize

    model = ssmq.models.SSMLM(ModelConfig(arch="llama", d_model=64, n_layer=1, vocab_size=16, attn_heads=2,
                                          attn_kv_heads=1, attn_head_dim=32, rotary_dim=32, mlp_hidden=64))
    for recipe in ("quamba2-w8a8", "ssdi8-w8a8"):
        with pytest.raises(SSMQError, match="not llama"):
            quantize(model, recipe, None, progress=False)


def test_info_footprint_of_a_llama(untied):
    from ssmq.runtime.footprint import footprint

    info = footprint(ssmq.load_model(untied[0]).config, 2)
    assert info["layers"] == "3 (3 attention)" and info["attn heads (q / kv) x dim"] == "(4 / 2) x 8"
    assert info["state per sequence"] == "0 B (no SSM layers)" and "d_model / d_inner / d_state" not in info
    assert info["KV cache per token"] == "192 B"  # 3 layers · K,V · 2 heads · 8 · 2 B
