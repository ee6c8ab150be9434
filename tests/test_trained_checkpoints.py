"""Quantized checkpoints of the trained reference models (../shared/models): no larger than their source (the
unquantized tensors stay in the source's dtype), and their compressed-tensors exports load in transformers +
compressed-tensors with ssmq's logits within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from conftest import shared_or_skip
from ssmq.quant import RECIPES, get_recipe, load_calibration, quantize, save_quantized
from ssmq.quant.checkpoint import source_bytes, source_dtype

MAMBA2_RECIPES = [n for n, r in RECIPES.items() if "mamba2" in r.supported_archs]
FAST_SIZES = ["rtn-w4a16-g128"]


def _quantized(tmp_path, arch: str, recipe: str):
    from ssmq import load_model
    from ssmq.tokenizer import load_tokenizer

    src = shared_or_skip("models", arch)
    model = load_model(src, dtype=torch.float32)
    calib = None
    if get_recipe(recipe).needs_calibration():
        shared_or_skip("data", "train")
        calib = load_calibration(n_samples=4, seqlen=64, tokenizer=load_tokenizer(src))
    quantize(model, recipe, calib, batch_size=4, progress=False)
    return src, save_quantized(model, tmp_path / "q", extra_files=[src / "tokenizer.json"], dtype=source_dtype(src))


def _check_size(tmp_path, recipe):
    src, q = _quantized(tmp_path, "mamba2", recipe)
    assert source_dtype(src) == torch.bfloat16
    assert source_bytes(q) <= source_bytes(src), f"{recipe}: {source_bytes(q)} > {source_bytes(src)} bytes"


@pytest.mark.parametrize("recipe", FAST_SIZES)
def test_checkpoint_is_no_larger_than_its_source(tmp_path, recipe):
    _check_size(tmp_path, recipe)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in MAMBA2_RECIPES if r not in FAST_SIZES])
def test_every_recipe_checkpoint_is_no_larger_than_its_source(tmp_path, recipe):
    """The rotating recipes (hadamard, SSDi8's) included: the trained mamba2's embedding (71% of its parameters)
    stays tied to lm_head, one matrix in the source's dtype (the residual rotation runs online at the two ends)."""
    _check_size(tmp_path, recipe)


@pytest.mark.parametrize("arch,recipe", [("mamba2", "rtn-w4a16-g128"), ("mamba1", "rtn-w4a16-g128"),
                                         ("hybrid", "rtn-w4a16-g128"),
                                         pytest.param("mamba2", "rtn-w8a16", marks=pytest.mark.slow)])
def test_export_of_trained_model_matches_in_transformers(tmp_path, arch, recipe):
    """transformers 5.17 + compressed-tensors 0.20 load the export (a 4-bit Mamba out_proj written int-quantized,
    since transformers' Mamba init reads its .weight) and give ssmq's logits within float32 rounding."""
    pytest.importorskip("compressed_tensors")
    tf = pytest.importorskip("transformers")
    import ssmq
    from ssmq.quant.compressed_tensors import export_compressed_tensors

    _, q = _quantized(tmp_path, arch, recipe)
    out = export_compressed_tensors(q, tmp_path / "ct")
    ids = torch.randint(0, 50000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ssmq.load_model(q, dtype=torch.float32)(ids)
        assert torch.equal(ssmq.load_model(out, dtype=torch.float32)(ids), ref)
        theirs = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert (theirs - ref).abs().max() < 1e-5 * ref.abs().max()
    from ssmq.runtime.info import describe

    info = describe(out)  # ssmq info on the export: the recipe it came from and its groups
    assert info["model"]["architecture"] == arch and info["quantization"]["recipe"] == recipe
    assert info["quantization"]["compressed-tensors format"].startswith(
        "mixed-precision" if arch != "hybrid" else "pack-quantized")
