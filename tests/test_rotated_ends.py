"""A residual-stream rotation (QuaRot-style ``hadamard`` transform) on a model whose lm_head is tied to its
embedding keeps them one matrix: the rotation runs online after the embedding lookup (``RotatedEmbedding``) and is
undone before the final norm (``UnrotatingRMSNorm``), with the same logits as the version folded into two matrices;
the checkpoint stores the one matrix and says so in quantization.json."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn

from test_kernels import DEV, kernel_module  # first: sets TRITON_INTERPRET before any kernel is decorated
from ssmq.errors import SSMQError
from ssmq.quant import get_recipe, load_model, quantize, save_quantized
from ssmq.quant.hadamard import (RotatedEmbedding, UnrotatingRMSNorm, hadamard_matrix, hadamard_transform,
                                 hadamard_transform_gemm)
from ssmq.quant.recipe import Rule, Transform
from ssmq.quant.rotation import rotate_model_
from tiny_ssm import synthetic_calibration, tiny_model

ROTATING = ["hadamard-w8a8", "ssdi8-w8a8", "ssdi8-w4a8"]
# online ends vs folded, both quantized: dynamic activation codes see the same inputs up to float rounding
# (hadamard-w8a8: 3e-7 apart); SSDi8's int8 scan rounds B, C, x and the state at static scales calibrated on
# those inputs, and a few codes flip at rounding boundaries (0.9% of the logits' norm on this random tiny model,
# against 5% between either and the float model; with the int8 scan off the two are 4e-7 apart)
BOUND = {"hadamard-w8a8": 1e-5, "ssdi8-w8a8": 2e-2, "ssdi8-w4a8": 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _folded(recipe: str):
    """The recipe with the rotation folded into the embedding and an untied lm_head."""
    r = get_recipe(recipe)
    return r.with_changes(transforms=[Transform(t.name, {**t.params, "online_ends": False}) if t.name == "hadamard"
                                      else t for t in r.transforms])


@pytest.mark.parametrize("n", [16, 12, 96, 384, 5120])
def test_inverse_transform_undoes_the_transform(n):
    """Q.T x = x @ H / sqrt(n): not the transform itself where the base (Paley I) is not symmetric (96, 384)."""
    x = torch.randn(2, 3, n, dtype=torch.float64)
    ref = x @ hadamard_matrix(n).double() / math.sqrt(n)
    torch.testing.assert_close(hadamard_transform(x, inverse=True), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform_gemm(x, inverse=True), ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x), inverse=True), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x, inverse=True)), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch,d_model", [("mamba2", 128), ("mamba2", 96), ("mamba1", 128), ("hybrid", 128)])
def test_online_ends_equal_the_folded_rotation(arch, d_model):
    """Prefill and decode logits of the online-ends rotation equal the folded one's (and the float model's) within
    float32 rounding; the embedding and lm_head stay one unchanged matrix, the final norm keeps its weight."""
    m = tiny_model(arch, d_model=d_model)
    folded, online = copy.deepcopy(m), copy.deepcopy(m)
    rotate_model_(folded, online=True, online_ends=False)
    rotate_model_(online, online=True, online_ends=True)
    assert isinstance(online.embedding, RotatedEmbedding) and isinstance(online.norm_f, UnrotatingRMSNorm)
    assert online.lm_head.weight is online.embedding.weight and online.config.tie_embeddings
    assert torch.equal(online.embedding.weight, m.embedding.weight)
    assert torch.equal(online.norm_f.weight, m.norm_f.weight) and not torch.all(m.norm_f.weight == 1)
    assert folded.lm_head.weight is not folded.embedding.weight  # what the online ends avoid
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, f, o = m(ids), folded(ids), online(ids)
        assert _rel(o, f) < 1e-5 and _rel(o, ref) < 1e-5
        caches = [x.allocate_cache(2, 16) for x in (folded, online)]
        for t in range(4):  # the decode path (step) goes through the same ends
            fs, os_ = folded.step(ids[:, t], caches[0]), online.step(ids[:, t], caches[1])
            assert _rel(os_, fs) < 1e-5 and _rel(os_, ref[:, t]) < 1e-5


@pytest.mark.parametrize("recipe", ROTATING)
def test_rotating_recipes_keep_one_tied_matrix(tmp_path, recipe):
    """The built-in rotating recipes keep the tie; the checkpoint stores the matrix once (no lm_head.weight), records
    the online ends as module kinds, loads back bit-identical and tied; the logits are those of the folded version
    up to quantization codes flipped by float rounding."""
    calib = synthetic_calibration(64, 4, 32)
    q = quantize(tiny_model("mamba2"), recipe, calib, progress=False)
    assert isinstance(q.embedding, RotatedEmbedding) and isinstance(q.norm_f, UnrotatingRMSNorm)
    assert q.lm_head.weight is q.embedding.weight and q.config.tie_embeddings
    folded = quantize(tiny_model("mamba2"), _folded(recipe), calib, progress=False)
    assert type(folded.embedding) is nn.Embedding and not folded.config.tie_embeddings
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, other = q(ids), folded(ids)
    assert _rel(ref, other) < BOUND[recipe], _rel(ref, other)
    save_quantized(q, tmp_path / "q")
    save_quantized(folded, tmp_path / "f")
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert manifest["modules"]["embedding"]["kind"] == "RotatedEmbedding"
    assert manifest["modules"]["norm_f"]["kind"] == "UnrotatingRMSNorm"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "embedding.weight" in f.keys()
    size = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert size < (tmp_path / "f" / "model.safetensors").stat().st_size - 64 * 128 * 4 // 2
    from ssmq.runtime.info import describe

    assert describe(tmp_path / "q")["quantization"]["residual rotation"].startswith("online at both ends")
    loaded = load_model(tmp_path / "q")
    assert isinstance(loaded.embedding, RotatedEmbedding) and loaded.lm_head.weight is loaded.embedding.weight
    with torch.no_grad():
        assert torch.equal(loaded(ids), ref)


def test_untied_or_quantized_ends_are_folded():
    """The online ends only where they keep a tie: an untied model, or a recipe that quantizes lm_head (or the
    embedding), gets the rotation folded into its weights as before."""
    untied = quantize(tiny_model("mamba2", tie_embeddings=False), "hadamard-w8a8", None, progress=False)
    assert type(untied.embedding) is nn.Embedding and type(untied.norm_f) is not UnrotatingRMSNorm
    r = get_recipe("hadamard-w8a8")
    head = r.with_changes(linears=[*r.linears, Rule(["lm_head"], r.linears[0].weight, r.linears[0].act)])
    q = quantize(tiny_model("mamba2"), head, None, progress=False)
    assert type(q.embedding) is nn.Embedding and not q.config.tie_embeddings


def test_online_ends_have_no_compressed_tensors_form(tmp_path):
    from ssmq.quant.compressed_tensors.export import check_exportable

    q = quantize(tiny_model("mamba2"), "hadamard-w8a8", None, progress=False)
    save_quantized(q, tmp_path / "q")
    manifest = json.loads((tmp_path / "q" / "quantization.json").read_text())
    with pytest.raises(SSMQError, match="residual stream after the embedding lookup.*no representation"):
        check_exportable(manifest, "q")


@pytest.mark.gpu
def test_online_ends_on_cuda_equal_cpu_and_replay_in_graphs():
    """On CUDA (the Hadamard as two GEMMs, the Triton norm): the CPU logits within float32 rounding (float16: a few
    ulps), and CUDA-graph decode equals eager decode (no host sync in the ends)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (whole models on the GPU)")
    from ssmq.runtime.cuda_graph import CudaGraphDecoder

    m = tiny_model("mamba2", d_model=96)
    rotate_model_(m, online=True, online_ends=True)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(ids)
        gpu = copy.deepcopy(m).cuda()
        assert _rel(gpu(ids.cuda()).cpu(), ref) < 1e-4
        assert _rel(copy.deepcopy(m).half().cuda()(ids.cuda()).float().cpu(), ref) < 2e-2
    dec = CudaGraphDecoder(gpu, max_batch=2, max_seqlen=32)
    cache = gpu.allocate_cache(2, 32)
    slots = torch.arange(2, device="cuda")
    with torch.inference_mode():
        for t in range(6):
            tokens = ids[:, t].cuda()
            eager = gpu.step(tokens, cache, slots).float()
            torch.testing.assert_close(dec(tokens, slots).float(), eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16])
def test_triton_norm_of_the_unrotated_stream(wdtype):
    """What ``UnrotatingRMSNorm`` hands the Triton norm on CUDA: a float32 stream (Q.T of the sum), no residual, the
    weight in the model's dtype; equal to the reference (runs under SSMQ_TRITON_INTERPRET=1 too)."""
    from ssmq import ops

    norm = kernel_module("norm")
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(3, 5, 384, generator=g), torch.randn(3, 5, 384, generator=g)
    r = hadamard_transform((x + res).to(DEV), inverse=True)
    w = (1 + 0.1 * torch.randn(384, generator=g)).to(device=DEV, dtype=wdtype)
    out, _ = norm.rms_norm(r, w, 1e-5, None, True)
    ref, _ = ops.rms_norm_ref(r, w, 1e-5, None, True)
    assert out.dtype == wdtype and _rel(out.float().cpu(), ref.float().cpu()) < 1e-3
