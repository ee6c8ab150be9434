"""Quantized models on CUDA: the low-bit kernels give the reference path's logits, and CUDA-graph decode and
prefill of a quantized model equal eager decode (no host syncs or stray allocations in the quantized forward)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import save_tiny

import ssmq
from ssmq import kernels, ops
from ssmq.quant import Recipe, quantize, save_quantized
from ssmq.quant.recipe import RECIPES
from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill
from ssmq.runtime.generate import generate
from ssmq.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
RECIPE_NAMES = ["rtn-w8a16", "rtn-w4a16-g128", "dynamic-w8a8", "fp8-w8a8"]


def _recipe(name: str) -> Recipe:
    d = RECIPES[name].to_dict()
    for r in d["linears"]:  # the tiny models are 32 / 64 wide: groups of 32
        if r["weight"]["granularity"].startswith("per_group"):
            r["weight"]["granularity"] = "per_group:32"
    return Recipe.from_dict(d)


@pytest.fixture(scope="module", params=[(a, r) for a in ("mamba1", "mamba2") for r in RECIPE_NAMES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized_folder(request, tmp_path_factory):
    arch, recipe = request.param
    src, out = tmp_path_factory.mktemp(arch), tmp_path_factory.mktemp("q")
    save_tiny(arch, src)
    model = ssmq.load_model(src)
    quantize(model, _recipe(recipe), None, progress=False)
    save_quantized(model, out / "q")
    return out / "q"


def test_kernels_match_the_reference_path(quantized_folder, monkeypatch):
    model = ssmq.load_model(quantized_folder, dtype=torch.float16, device="cuda")
    ids = torch.randint(0, 96, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.inference_mode():
        out = model(ids).float()
        monkeypatch.setattr(kernels, "quant_linear", ops.quant_linear_ref)
        monkeypatch.setattr(kernels, "quantize_act", ops.quantize_act_ref)
        ref = model(ids).float()
    assert ((out - ref).norm() / ref.norm()).item() < 5e-3


def test_quantized_cuda_graphs_equal_eager(quantized_folder):
    model = ssmq.load_model(quantized_folder, dtype=torch.float16, device="cuda")
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    eager = generate(model, prompts, params)
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=64)
    assert generate(model, prompts, params, cache=dec.cache, decode_fn=dec) == eager
    ids = torch.randint(0, 96, (1, 25), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        full = model(ids)
        pre = CudaGraphPrefill(model, dec.cache, max_len=32, pool=dec.pool)
        torch.testing.assert_close(pre(ids, slot=1), full[:, 24], atol=2e-2, rtol=2e-2)
