"""``ssmq bench latency``: time to first token (prefill of one prompt) and time per output token (one decode step
of the whole batch) against batch size, for each recipe side by side, and for the peers when installed: ``mamba_ssm``
(Mamba-1 and Mamba-2 architectures) and transformers (the families of ``ssmq.models.families``).

On CUDA, prefill and decode replay CUDA graphs, as ``ssmq generate`` runs them; on the CPU they run eagerly.
Each decode row carries the bytes a step must move at least: the model's weights as built, read once
(``weights_GB``), and the batch's SSM and conv states, read and written (``state_GB``; an attention layer's KV cache
is not counted); on CUDA also the time those bytes take at the copy bandwidth measured at the start of the same run
(``limit_ms``, the step's bandwidth limit) and its share of the step (``share``).
"""

from __future__ import annotations

import gc
import itertools
import re

import torch
from tqdm import tqdm

from ssmq.bench.models import (build, mamba_ssm_available, mamba_ssm_model, published_config,
                               transformers_available, transformers_model)
from ssmq.bench.output import lines_plot, record, table, write
from ssmq.bench.timing import copy_bandwidth, time_fn


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage once (tied weights, views): what a decode step
    reads, but for an untied input embedding, counted whole though a step reads one row a sequence of it."""
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def state_bytes(model) -> int:
    """Bytes of one sequence's SSM and conv states (every Mamba layer, in the model's own state format)."""
    from ssmq.models.state import MambaState

    cache = model.allocate_cache(1, 16)
    return sum(st.nbytes() for st in cache.states if isinstance(st, MambaState))


@torch.inference_mode()
def ttft_ms(model, prompt_len: int, warmup: int, reps: int, profile: bool = False):
    """Prefill of one ``prompt_len``-token prompt to its first token (batch 1), ms. With ``profile``: (ms, the
    per-kernel profile rows of the prefill, ``ssmq.bench.profile.kernel_profile``, each call from an empty slot)."""
    dev = model.device
    ids = torch.randint(0, min(model.config.vocab_size, 50000), (1, prompt_len), device=dev)
    cache = model.allocate_cache(2, prompt_len + 1)
    if dev.type == "cuda":
        from ssmq.runtime.cuda_graph import CudaGraphPrefill

        prefill = CudaGraphPrefill(model, cache, max_len=prompt_len)

        def first():
            return prefill(ids, 0).argmax(-1)
    else:
        def first():
            return model(ids, cache, [0], num_last_tokens=1).argmax(-1)
    ms = time_fn(first, dev, warmup, reps, setup=lambda: cache.reset([0])).median_ms
    if not profile:
        return ms
    from ssmq.bench.profile import kernel_profile

    def from_empty():
        cache.reset([0])
        return first()

    return ms, kernel_profile(from_empty, dev, ms, max(1, min(reps, 4)))


def decode_step(model, batch: int, max_len: int):
    """One decode step of ``batch`` sequences as ``ssmq generate`` runs it: a CUDA-graph replay on a GPU (captured
    here), the eager step on the CPU. Every call adds a token to each sequence; ``max_len`` bounds the calls."""
    dev = model.device
    tokens = torch.randint(0, min(model.config.vocab_size, 50000), (batch,), device=dev)
    slots = torch.arange(batch, device=dev)
    if dev.type == "cuda":
        from ssmq.runtime.cuda_graph import CudaGraphDecoder

        dec = CudaGraphDecoder(model, max_batch=batch, max_seqlen=max_len, buckets=(batch,))
        dec(tokens, slots)  # captures the graph
        return dec.graphs[batch][0].replay
    cache = model.allocate_cache(batch, max_len)
    return lambda: model.step(tokens, cache, slots)


@torch.inference_mode()
def tpot_ms(model, batch: int, steps: int, warmup: int, reps: int, profile: bool = False):
    """One decode step of ``batch`` sequences, ms: the mean over ``steps`` consecutive steps, median of ``reps``.
    With ``profile``: (ms, the per-kernel profile rows of the step captured without programmatic dependent launch,
    ``ssmq.bench.profile.kernel_profile``, whose step time they share out)."""
    max_len = (warmup + reps + 4) * steps + 16  # every step (capture, warm-up, the profile included) adds a token

    def step_ms(step) -> float:
        def run():
            for _ in range(steps):
                step()
        return time_fn(run, model.device, warmup, reps).median_ms / steps

    ms = step_ms(decode_step(model, batch, max_len))
    if not profile:
        return ms
    from ssmq.bench.profile import kernel_profile
    from ssmq.kernels import policy

    # Under programmatic dependent launch a kernel starts while its predecessor runs and waits inside, so its
    # recorded time includes its predecessor's tail: the profile runs a step captured without PDL, timed on its own.
    with policy.using(policy.active().with_changes(pdl=False)):
        plain = decode_step(model, batch, max_len)
    return ms, kernel_profile(plain, model.device, step_ms(plain), steps)


@torch.inference_mode()
def mamba_ssm_rows(cfg, device, dtype, prompt_lens, batches, steps, warmup, reps) -> list[dict]:
    """TTFT and TPOT of mamba_ssm's model of the same architecture (its Triton kernels and CUDA-graph decode)."""
    model = mamba_ssm_model(cfg, device, dtype)
    rows = []
    for length in prompt_lens:
        ids = torch.randint(0, 50000, (1, length), device=device)
        ms = time_fn(lambda: model(ids, num_last_tokens=1).logits.argmax(-1), device, warmup, reps).median_ms
        rows.append({"impl": "mamba_ssm", "batch": 1, "prompt_len": length, "ttft_ms": ms})
    for bs in batches:
        ids = torch.randint(0, 50000, (bs, 16), device=device)
        model.generate(ids, max_length=18, cg=True, return_dict_in_generate=True, output_scores=False)
        cache = model._decoding_cache  # replays of the decode graph its generate() captured
        tok = torch.zeros((bs, 1), dtype=torch.long, device=device)
        pos = torch.full((bs, 1), 16, dtype=torch.long, device=device)
        ms = time_fn(lambda: cache.run(tok, pos, 16), device, warmup, reps * steps).median_ms
        rows.append({"impl": "mamba_ssm", "batch": bs, "tpot_ms": ms, "tok_s": bs / ms * 1e3})
    del model
    return rows


@torch.inference_mode()
def transformers_rows(name: str, device, dtype, prompt_lens, batches, steps, warmup, reps) -> tuple[list[dict], list]:
    """TTFT and TPOT of the family's transformers model (``bench.models.transformers_model``) as its users run it:
    TTFT a forward of the prompt (last position's logits); TPOT from ``generate`` (greedy, its default cache, eager),
    the time for ``steps`` + 1 new tokens less the time for 1, over ``steps``, after 16-token prompts.
    Returns (rows, the measurements that ran out of memory, each in words); one that does leaves the others."""
    model = transformers_model(name, device, dtype)
    vocab = min(model.config.vocab_size, 50000)
    rows, short = [], []

    def timed(what: str, fn) -> float | None:
        try:
            return time_fn(fn, device, warmup, reps).median_ms
        except torch.OutOfMemoryError as e:
            asked = re.search(r"Tried to allocate ([\d.]+ \w+)", str(e))
            short.append(f"{what}: out of memory" + (f" (asked for {asked.group(1)})" if asked else ""))
            _free(device)
            return None

    for length in prompt_lens:
        ids = torch.randint(0, vocab, (1, length), device=device)
        ms = timed(f"TTFT at {length} tokens", lambda: model(ids, logits_to_keep=1).logits.argmax(-1))
        if ms is not None:
            rows.append({"impl": "transformers", "batch": 1, "prompt_len": length, "ttft_ms": ms})
    for bs in batches:
        ids = torch.randint(0, vocab, (bs, 16), device=device)

        def generate(n: int):
            return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                          min_new_tokens=n, do_sample=False, pad_token_id=0)

        long_ms = timed(f"TPOT at batch {bs}", generate(steps + 1))
        short_ms = None if long_ms is None else timed(f"TPOT at batch {bs}", generate(1))
        if short_ms is not None:
            ms = (long_ms - short_ms) / steps
            rows.append({"impl": "transformers", "batch": bs, "tpot_ms": ms, "tok_s": bs / ms * 1e3})
    del model
    return rows, short


def _peer_rows(args, device, dtype) -> tuple[list[dict], dict]:
    """The rows of the peers asked for that are installed and run this architecture, and {peer: why it failed}."""
    cfg = published_config(args.model, args.layers)
    rows, errors = [], {}
    if cfg is None:
        return rows, errors
    timing = (args.input_len, args.batch_size, args.steps, args.warmup, args.reps)
    if "mamba_ssm" in args.peers and device.type == "cuda" and mamba_ssm_available() and \
            cfg.arch in ("mamba1", "mamba2") and not getattr(cfg, "family", ""):  # its models
        try:
            rows += mamba_ssm_rows(cfg, device, dtype, *timing)
        except Exception as e:  # a peer that cannot run this model is reported, not fatal
            errors["mamba_ssm"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "transformers" in args.peers and transformers_available() and getattr(cfg, "family", "") \
            and args.layers is None:  # the published config as a whole: transformers reads it unchanged
        _free(device)
        try:
            peer, short = transformers_rows(args.model, device, dtype, *timing)
            rows += peer
            if short:
                errors["transformers"] = "; ".join(short)
        except Exception as e:
            errors["transformers"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return rows, errors


def run(args) -> dict:
    from ssmq.bench.models import device_and_dtype

    device, dtype = device_and_dtype(args.device, args.dtype)
    batches, prompt_lens = args.batch_size, args.input_len
    result = record("latency", device, model=args.model, dtype=str(dtype).removeprefix("torch."),
                    steps=args.steps, warmup=args.warmup, reps=args.reps)
    impls = list(args.recipes)
    bandwidth = None
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        result["copy_bandwidth_GBps"] = bandwidth / 1e9
    bar = tqdm(total=len(impls) * (len(prompt_lens) + len(batches)) + 1, desc="latency", unit="run")
    for recipe in impls:
        _free(device)
        model, _ = build(args.model, recipe, device, dtype, args.layers, args.gptq_as_rtn)
        weights, state = weight_bytes(model), state_bytes(model)
        for length in prompt_lens:
            ms = ttft_ms(model, length, args.warmup, args.reps, args.profile)
            if args.profile:
                ms, kernels = ms
                result.setdefault("prefill_profile", []).extend(
                    {"impl": recipe, "prompt_len": length, **k} for k in kernels)
            result["rows"].append({"impl": recipe, "batch": 1, "prompt_len": length, "ttft_ms": ms})
            bar.update()
        for bs in batches:
            ms = tpot_ms(model, bs, args.steps, args.warmup, args.reps, args.profile)
            if args.profile:
                ms, kernels = ms
                result.setdefault("profile", []).extend({"impl": recipe, "batch": bs, **k} for k in kernels)
            states = 2 * bs * state  # read and written
            row = {"impl": recipe, "batch": bs, "tpot_ms": ms, "tok_s": bs / ms * 1e3, "weights_GB": weights / 1e9,
                   "state_GB": states / 1e9}
            if bandwidth:
                limit = (weights + states) / bandwidth * 1e3
                row |= {"limit_ms": limit, "share": limit / ms}
            result["rows"].append(row)
            bar.update()
        del model
    _free(device)
    peer_rows, errors = _peer_rows(args, device, dtype)
    result["rows"] += peer_rows
    if errors:
        result["peer_errors"] = errors
    bar.update()
    bar.close()
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)")
    print(table(result["rows"], ["impl", "batch", "prompt_len", "ttft_ms", "tpot_ms", "tok_s", "weights_GB", "state_GB",
                                 "limit_ms", "share"]))
    if result.get("prefill_profile"):
        print("\nper prefill (time to first token):")
        print(table(result["prefill_profile"], ["impl", "prompt_len", "kernel", "calls", "us", "share"]))
    if result.get("profile"):
        print("\nper decode step:")
        print(table(result["profile"], ["impl", "batch", "kernel", "calls", "us", "share"]))
    for path in write(result, args.out, plot=_plot):
        print(f"wrote {path}")
    return result


def _plot(pyplot, result):
    return lines_plot(pyplot, {**result, "rows": [r for r in result["rows"] if "tpot_ms" in r]}, "batch", "tpot_ms",
                      "impl", "batch", "time per output token (ms)")
