"""FP16 foundation: ssmq's models equal transformers' on the same weights, in both checkpoint formats."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import save_tiny

import ssmq
from ssmq.errors import SSMQError

ARCHS = ["mamba1", "mamba2", "hybrid", "llama"]


def hf_to_mamba_ssm(hf_folder, out_folder, arch: str) -> None:
    """Write the same weights in the original mamba_ssm layout (config.json + pytorch_model.bin)."""
    from safetensors.torch import load_file

    c = json.loads((hf_folder / "config.json").read_text())
    ssm_cfg = {"layer": "Mamba1", "d_state": c["state_size"], "d_conv": c["conv_kernel"], "expand": c["expand"],
               "dt_rank": c["time_step_rank"]}
    if arch == "mamba2":
        ssm_cfg = {"layer": "Mamba2", "d_state": c["state_size"], "d_conv": c["conv_kernel"], "expand": c["expand"],
                   "headdim": c["head_dim"], "ngroups": c["n_groups"], "chunk_size": c["chunk_size"]}
    cfg = {"d_model": c["hidden_size"], "n_layer": c["num_hidden_layers"], "vocab_size": c["vocab_size"],
           "ssm_cfg": ssm_cfg, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
           "pad_vocab_size_multiple": 8, "tie_embeddings": True}
    state = {k.replace("backbone.embeddings.", "backbone.embedding."): v
             for k, v in load_file(str(hf_folder / "model.safetensors")).items()}
    out_folder.mkdir()
    (out_folder / "config.json").write_text(json.dumps(cfg))
    torch.save(state, out_folder / "pytorch_model.bin")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, folder)
    return request.param, folder, hf


def test_model_loaded_under_inference_mode_runs_and_decodes(tiny):
    # parameters created under inference_mode are inference tensors (no version counter)
    _, folder, _ = tiny
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = ssmq.load_model(folder)(ids).detach()
    with torch.inference_mode():
        model = ssmq.load_model(folder)
        cache = model.allocate_cache(1, 16)
        model(ids[:, :8], cache, torch.tensor([0]))
        last = model.step(ids[:, 8], cache, torch.tensor([0]))
    torch.testing.assert_close(last, ref[:, 8], atol=1e-4, rtol=1e-4)


def test_logits_match_transformers(tiny):
    arch, folder, hf = tiny
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1))
    model = ssmq.load_model(folder)
    assert model.config.arch == arch
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_mamba_ssm_format_equals_hf_format(arch, tmp_path):
    save_tiny(arch, tmp_path / "hf", ngroups=1)
    hf_to_mamba_ssm(tmp_path / "hf", tmp_path / "ms", arch)
    ids = torch.randint(0, 96, (1, 19), generator=torch.Generator().manual_seed(2))
    a, b = ssmq.load_model(tmp_path / "hf"), ssmq.load_model(tmp_path / "ms")
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_prefill_then_decode_equals_full_forward(tiny):
    arch, folder, _ = tiny
    model = ssmq.load_model(folder)
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.allocate_cache(max_batch=4, max_seqlen=32)
        slots = torch.tensor([2, 0, 3])  # out of order: rows live in arbitrary cache slots
        pieces = [model(ids[:, :9], cache, slots), model(ids[:, 9:13], cache, slots)]  # two-part prefill
        pieces += [model.step(ids[:, t], cache, slots).unsqueeze(1) for t in range(13, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)
    assert cache.seqlens.tolist() == [20, 0, 20, 20]


def test_cache_reset_forgets_a_slot(tiny):
    _, folder, _ = tiny
    model = ssmq.load_model(folder)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = model.allocate_cache(2, 16)
        first = model(ids, cache, [1])
        cache.reset([1])
        torch.testing.assert_close(model(ids, cache, [1]), first, atol=0, rtol=0)


# ---------------------------------------------------------------- bad input

def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(SSMQError, match="unknown architecture"):
        ssmq.load_model(tmp_path)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(SSMQError, match="no config.json"):
        ssmq.load_model(tmp_path)
    save_tiny("mamba1", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(SSMQError, match="no weights"):
        ssmq.load_model(tmp_path / "m")


def test_corrupt_weights(tmp_path):
    save_tiny("mamba2", tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(SSMQError, match="cannot read weights"):
        ssmq.load_model(tmp_path)


def test_shape_mismatch(tmp_path):
    save_tiny("mamba2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["state_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SSMQError, match="shape mismatch"):
        ssmq.load_model(tmp_path)


def test_missing_path_and_offline_hub_id(monkeypatch):
    with pytest.raises(SSMQError, match="does not exist"):
        ssmq.load_model("/no/such/folder")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SSMQError, match="could not download .* pass a local folder"):
        ssmq.load_model("state-spaces/definitely-not-a-model")
