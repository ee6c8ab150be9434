"""``ssmq bench throughput``: offline generation of ``--num-prompts`` random prompts of ``--input-len`` tokens,
``--output-len`` new tokens each (no early stop), ``--max-batch`` sequences at a time; requests/s and tokens/s for
each recipe. On CUDA the decode replays CUDA graphs, as ``ssmq generate`` does."""

from __future__ import annotations

import gc

import torch
from tqdm import tqdm

from ssmq.bench.models import build, device_and_dtype
from ssmq.bench.output import record, table, write
from ssmq.bench.timing import wall


@torch.inference_mode()
def generate_all(model, prompts: list[list[int]], output_len: int, max_batch: int, bar=None) -> int:
    """Generate ``output_len`` tokens for every prompt, ``max_batch`` at a time; returns the tokens produced."""
    from ssmq.runtime.generate import stream_generate
    from ssmq.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=output_len, stop_at_eos=False)
    run: dict = {}
    if model.device.type == "cuda":
        from ssmq.runtime.cuda_graph import CudaGraphDecoder

        dec = CudaGraphDecoder(model, max_batch=max_batch, max_seqlen=max(map(len, prompts)) + output_len)
        run = {"cache": dec.cache, "decode_fn": dec}
    produced = 0
    for i in range(0, len(prompts), max_batch):
        for _ in stream_generate(model, prompts[i:i + max_batch], params, **run):
            produced += 1
        if bar is not None:
            bar.update(len(prompts[i:i + max_batch]))
    return produced


def run(args) -> dict:
    device, dtype = device_and_dtype(args.device, args.dtype)
    result = record("throughput", device, model=args.model, dtype=str(dtype).removeprefix("torch."),
                    num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
                    max_batch=args.max_batch)
    gen = torch.Generator().manual_seed(args.seed)
    for recipe in args.recipes:
        gc.collect()
        model, vocab = build(args.model, recipe, device, dtype, args.layers, args.gptq_as_rtn)
        prompts = torch.randint(0, min(vocab, 50000), (args.num_prompts, args.input_len), generator=gen).tolist()
        generate_all(model, prompts[:1], 2, 1)  # warm-up: kernels compiled, graphs captured once
        with tqdm(total=len(prompts), desc=f"throughput {recipe}", unit="req") as bar:
            t0 = wall(device)
            produced = generate_all(model, prompts, args.output_len, args.max_batch, bar)
            seconds = wall(device) - t0
        result["rows"].append({"impl": recipe, "requests": len(prompts), "seconds": seconds,
                               "requests_s": len(prompts) / seconds, "output_tok_s": produced / seconds,
                               "total_tok_s": (produced + len(prompts) * args.input_len) / seconds})
        del model
    print(table(result["rows"], ["impl", "requests", "seconds", "requests_s", "output_tok_s", "total_tok_s"]))
    for path in write(result, args.out, plot=_plot):
        print(f"wrote {path}")
    return result


def _plot(pyplot, result):
    fig, ax = pyplot.subplots(figsize=(6, 4))
    names = [r["impl"] for r in result["rows"]]
    ax.bar(names, [r["output_tok_s"] for r in result["rows"]])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"ssmq bench throughput - {result['gpu']}", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    return fig
