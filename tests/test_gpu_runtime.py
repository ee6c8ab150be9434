"""GPU runtime: the model on CUDA (Triton kernels) equals the CPU reference; CUDA-graph decode equals eager decode."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import save_tiny

import ssmq
from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill
from ssmq.runtime.generate import generate
from ssmq.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
ARCHS = ["mamba1", "mamba2", "hybrid", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, folder)
    return folder


def test_cuda_forward_matches_cpu(tiny_folder):
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = ssmq.load_model(tiny_folder)(ids)
        out = ssmq.load_model(tiny_folder, device="cuda")(ids.cuda()).cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3


def test_cuda_graph_decode_equals_eager(tiny_folder):
    model = ssmq.load_model(tiny_folder, device="cuda")
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    eager = generate(model, prompts, params)
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=64)
    graphed = generate(model, prompts, params, cache=dec.cache, decode_fn=dec)
    assert graphed == eager


def test_cuda_graph_prefill_equals_eager_and_decodes_on(tiny_folder):
    model = ssmq.load_model(tiny_folder, device="cuda")
    ids = torch.randint(0, 96, (1, 29), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.inference_mode():
        full = model(ids)
        dec = CudaGraphDecoder(model, max_batch=2, max_seqlen=64)
        pre = CudaGraphPrefill(model, dec.cache, max_len=32, pool=dec.pool)
        last = pre(ids[:, :25], slots=1)  # 25 = 16 + 8 + 1: three graphs, each continuing the state
        torch.testing.assert_close(last, full[:, 24], atol=1e-4, rtol=1e-4)
        # .clone(): each call returns the graph's output buffer, which the next replay overwrites
        steps = [dec(ids[:, t], torch.tensor([1], device="cuda")).clone() for t in range(25, 29)]
    torch.testing.assert_close(torch.cat(steps), full[0, 25:], atol=1e-4, rtol=1e-4)
    assert int(dec.cache.seqlens[1]) == 29


def test_cuda_graph_prefill_of_several_rows_equals_eager(tiny_folder):
    """Three prompts, one of them already 7 tokens in, prefilled as one chunk of 25 tokens from graphs of 4 rows
    (a padding row on the scratch slot) equal the eager forward, and decode on from the decoder's graphs."""
    model = ssmq.load_model(tiny_folder, device="cuda")
    ids = torch.randint(0, 96, (3, 36), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        full = model(ids)
        dec = CudaGraphDecoder(model, max_batch=5, max_seqlen=64)
        pre = CudaGraphPrefill(model, dec.cache, max_len=32, pool=dec.pool, max_tokens=128)
        assert pre.serves(3, 25) and not pre.serves(3, 33) and not pre.serves(5, 32)
        pre(ids[:1, :7], slots=[0])
        chunk = torch.cat([ids[:1, 7:32], ids[1:, :25]])
        last = pre(chunk, slots=[0, 2, 4]).clone()
        torch.testing.assert_close(last[0], full[0, 31], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last[1:], full[1:, 24], atol=1e-4, rtol=1e-4)
        slots = torch.tensor([0, 2, 4], device="cuda")
        step = dec(torch.stack([ids[0, 32], ids[1, 25], ids[2, 25]]), slots).clone()
    torch.testing.assert_close(step, torch.stack([full[0, 32], full[1, 25], full[2, 25]]), atol=1e-4, rtol=1e-4)
    assert dec.cache.seqlens[[0, 2, 4]].tolist() == [33, 26, 26]


def test_engine_runner_prefills_a_chunk_too_large_for_one_graph_in_graph_sized_row_pieces(tiny_folder):
    """Six prompts of 24 tokens against graphs of up to 64 tokens (rows x 16-token piece: 4 rows at most): the
    serving runner prefills them as forwards of 4 and 2 rows from graphs, not one eager forward, and the last logits
    of every row equal the eager forward's."""
    from ssmq.runtime.engine import EngineConfig, LocalRunner

    model = ssmq.load_model(tiny_folder, device="cuda")
    ids = torch.randint(0, 96, (6, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    with torch.inference_mode():
        full = model(ids)
        runner = LocalRunner(model, EngineConfig(max_batch=8, max_model_len=64, prefill_chunk=32,
                                                 graph_prefill_tokens=64, graph_prefill_pieces=2,
                                                 kv_blocks=64, kv_block_size=4))
        if runner.kv_blocks is not None:  # hybrids: each slot's KV blocks, as the engine assigns them
            for s in range(6):
                runner.assign_blocks(s, 0, list(range(1 + 6 * s, 7 + 6 * s)))
        assert not runner.graph_prefill.serves(6, 24) and runner.graph_prefill.row_pieces(6, 24) == [4, 2]
        eager = model.forward
        model.forward = None  # an eager forward would fail: every piece must come from a graph
        try:
            last = runner.prefill(ids, list(range(6)), False)
        finally:
            model.forward = eager
    torch.testing.assert_close(last, full[:, -1], atol=1e-4, rtol=1e-4)


def test_bf16_generation_runs_on_reference_model():
    from conftest import shared_or_skip

    folder = shared_or_skip("models", "mamba2")
    model = ssmq.load_model(folder, dtype=torch.bfloat16, device="cuda")
    tok = ssmq.load_tokenizer(folder)
    out = generate(model, [tok.encode("The history of the city")], SamplingParams(max_new_tokens=16))
    assert len(out[0]) >= 1 and all(0 <= t < 50277 for t in out[0])


def test_cli_generate_on_cuda_decodes_from_graphs_like_eager(capsys):
    from conftest import shared_or_skip

    from ssmq.cli import main

    folder = shared_or_skip("models", "mamba2")
    outs = []
    for extra in ([], ["--eager"]):
        assert main(["generate", "--model", str(folder), "--device", "cuda", "--dtype", "float32",
                     "--prompt", "The history of", "--prompt", "In 1990 the", "--max-new-tokens", "12", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].count("--- ") == 2


def test_fp16_decode_on_cuda_matches_the_float32_reference(tiny_folder):
    """fp16 decode runs the decode-only kernels (GEMV, gated norm fused into out_proj): same logits as fp32 CPU."""
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = ssmq.load_model(tiny_folder)(ids)[:, 16:]
        model = ssmq.load_model(tiny_folder, dtype=torch.float16, device="cuda")
        cache = model.allocate_cache(2, 32)
        slots = torch.arange(2, device="cuda")
        model(ids[:, :16].cuda(), cache, slots)
        steps = [model.step(ids[:, t].cuda(), cache, slots).float().cpu() for t in range(16, 24)]
    out = torch.stack(steps, 1)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2



@pytest.fixture(scope="module", params=["zamba2", "falcon_h1"])
def side_attention_folder(request, tmp_path_factory):
    from hf_tiny import save_tiny_family

    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_family(request.param, folder)
    return folder


def test_side_attention_families_on_cuda(side_attention_folder):
    """Zamba2's shared blocks and Falcon-H1's parallel attention through the CUDA kernels: the forward equals the
    CPU reference, CUDA-graph decode (each block's Mamba-2 state and the attention's KV) equals eager decode."""
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))
    model = ssmq.load_model(side_attention_folder, device="cuda")
    with torch.no_grad():
        ref = ssmq.load_model(side_attention_folder)(ids)
        out = model(ids.cuda()).cpu()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=32)
    assert generate(model, prompts, params, cache=dec.cache, decode_fn=dec) == generate(model, prompts, params)


@pytest.mark.parametrize("family", ["granite_moe", "nemotron_moe", "jamba"])
def test_moe_families_decode_on_the_grouped_kernel(family, tmp_path):
    """CUDA-graph decode runs float experts on the grouped-GEMM kernel (``kernels.moe``): its forward equals the
    routed reference's, and its greedy tokens equal eager decode of a model whose experts stay routed."""
    from hf_tiny import save_tiny_family

    from ssmq.models.ffn import MoE

    save_tiny_family(family, tmp_path)
    routed = ssmq.load_model(tmp_path, device="cuda")
    model = ssmq.load_model(tmp_path, device="cuda")
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=32)
    assert {m.mode for m in model.modules() if isinstance(m, MoE)} == {"grouped"}
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0), device="cpu").cuda()
    with torch.no_grad():
        ref, out = routed(ids), model(ids)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-4
    prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
    params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
    assert generate(model, prompts, params, cache=dec.cache, decode_fn=dec) == generate(routed, prompts, params)


@pytest.mark.parametrize("recipe", ["rtn-w8a16", "fp8-w8a8"])
@pytest.mark.parametrize("family", ["granite_moe", "nemotron_moe"])
def test_quantized_moe_families_decode_on_the_grouped_kernel(family, recipe, tmp_path):
    """CUDA-graph decode runs quantized experts of the kernel's formats grouped too: the forward equals the experts run
    as their own ``QuantLinear``s; weight-only, greedy tokens equal eager decode with routed experts."""
    from hf_tiny import save_tiny_family

    from ssmq.models.ffn import MoE
    from ssmq.quant import quantize

    save_tiny_family(family, tmp_path)
    routed, model = (quantize(ssmq.load_model(tmp_path, device="cuda"), recipe, None, progress=False)
                     for _ in range(2))
    dec = CudaGraphDecoder(model, max_batch=4, max_seqlen=32)
    assert {m.mode for m in model.modules() if isinstance(m, MoE)} == {"grouped"}
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0), device="cpu").cuda()
    with torch.no_grad():
        ref, out = routed(ids), model(ids)
    assert ((out - ref).norm() / ref.norm()).item() < (2e-3 if recipe == "fp8-w8a8" else 1e-4)
    if recipe == "rtn-w8a16":
        prompts = [[5, 7, 9, 11, 3], [2], [8, 8, 1, 4, 60]]
        params = SamplingParams(max_new_tokens=8, stop_at_eos=False)
        assert generate(model, prompts, params, cache=dec.cache, decode_fn=dec) == generate(routed, prompts, params)
