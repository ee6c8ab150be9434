"""`ssmq plan` against the GPU: for published configs (random weights, fp16), the bytes the plan predicts for weights +
cache (``make_plan`` / ``cache_bytes``) vs what the GPU allocates for them, and the activation peak of one chunked
prefill (512 tokens into one slot) plus one decode step of every slot vs the plan's reserve (10% of the GPU).

    python benchmarks/check_plan_memory.py [--json out.json] [--largest-batch mamba2-2.7b:2048]

Target (issue 17): weights + cache within 5% of the plan, for the float KV cache and for quantized KV formats (a
``KVQuantizer`` of the format on every attention layer, uncalibrated: bytes, not accuracy; prefill and decode then
run through the quantized cache). ``--largest-batch MODEL:CONTEXT`` (issue 13's capacity
target): for each SSM state format (fp16, int8, int8 with row scales) the largest batch the plan fits at that context
on this GPU (10% reserve) is allocated for real, a 512-token prompt prefilled into one slot and one decode step run
over every slot; the step's time (eager, after one warm-up step) and the peak are recorded.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.models.kv_format import kv_format  # noqa: E402
from ssmq.runtime.plan import CacheFormat, cache_bytes, make_plan  # noqa: E402

# (model, batch, context, state dtype[, KV format])
CASES = [("mamba2-2.7b", 64, 2048, "float16"), ("mamba2-2.7b", 64, 2048, "int8"), ("bamba-9b", 8, 8192, "float16"),
         ("bamba-9b", 8, 8192, "int8"), ("bamba-9b", 8, 32768, "float16", "nuq3-1%"),
         ("bamba-9b", 8, 32768, "float16", "nuq4"), ("bamba-9b", 8, 32768, "int8", "nuq2-1%"),
         ("bamba-9b", 8, 32768, "float16", "fp8")]


def quantize_kv(model, kv) -> None:
    """Every attention layer caches in KV format ``kv`` (placeholder codebooks and scales)."""
    from ssmq.models.kv_quantizer import KVQuantizer

    for i, layer in enumerate(model.layers):
        if hasattr(layer.mixer, "kv_quant"):
            m = layer.mixer
            m.kv_quant = KVQuantizer(kv.spec, m.hkv, m.e, i).to(next(model.parameters()).device)


def measure(name: str, batch: int, context: int, state_dtype: str, kv_name: str = "fp16") -> dict:
    cfg = PUBLISHED[name]
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = random_model(cfg, dtype=torch.float16)
    int8 = state_dtype.startswith("int8")
    if int8:  # the int8 state format with placeholder scales (or row scales): bytes, not accuracy
        for layer in model.layers:
            if hasattr(layer.mixer, "enable_int8_state"):
                layer.mixer.enable_int8_state(1, rows=state_dtype == "int8-rows")
    kv = kv_format(kv_name)
    if not kv.is_float:
        quantize_kv(model, kv)
    cache = model.allocate_cache(batch, context, ssm_dtype=torch.int8 if int8 else None)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda")
        model(ids, cache, torch.zeros(1, dtype=torch.long, device="cuda"), num_last_tokens=1)
        tokens, slots = torch.zeros(batch, dtype=torch.long, device="cuda"), torch.arange(batch, device="cuda")
        model.step(tokens, cache, slots)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.step(tokens, cache, slots)
        end.record()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    gpu = torch.cuda.get_device_properties(0).total_memory
    fmt = CacheFormat("float16", state_dtype, kv)
    plan = make_plan(cfg, name, fmt, gpu, gpu // 10, batch, context)
    predicted = plan.weights + cache_bytes(cfg, fmt, batch, context)
    row = {"model": name, "batch": batch, "context": context, "state": state_dtype, "kv": kv_name,
           "predicted_weights_cache_GB": predicted / 1e9, "allocated_weights_cache_GB": allocated / 1e9,
           "ratio": allocated / predicted, "activation_peak_GB": (peak - allocated) / 1e9,
           "reserve_GB": plan.reserve / 1e9, "peak_GB": peak / 1e9, "plan_memory_GB": plan.memory(batch, context, cfg) / 1e9,
           "gpu_GB": gpu / 1e9, "eager_step_ms": start.elapsed_time(end)}
    del model, cache
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--largest-batch", default=None, help="MODEL:CONTEXT, e.g. mamba2-2.7b:2048")
    args = ap.parse_args()
    rows = []
    cases = CASES
    if args.largest_batch:
        name, context = args.largest_batch.split(":")
        gpu = torch.cuda.get_device_properties(0).total_memory
        cases = [(name, make_plan(PUBLISHED[name], name, CacheFormat("float16", st, kv_format("fp16")), gpu, gpu // 10,
                                  1, int(context)).max_batch, int(context), st)
                 for st in ("float16", "int8", "int8-rows")]
    print(f"{'model':<12} {'b':>3} {'ctx':>5} {'state':>7} {'KV':>8} {'plan GB':>8} {'alloc GB':>8} {'ratio':>6} "
          f"{'act. peak GB':>12} {'reserve GB':>10}")
    for case in cases:
        try:
            r = measure(*case)
        except Exception as e:  # noqa: BLE001 - report, go on
            r = {"case": case, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(case, r["error"], flush=True)
            rows.append(r)
            continue
        rows.append(r)
        print(f"{r['model']:<12} {r['batch']:>3} {r['context']:>5} {r['state']:>7} {r['kv']:>8} "
              f"{r['predicted_weights_cache_GB']:>8.3f} {r['allocated_weights_cache_GB']:>8.3f} {r['ratio']:>6.3f} "
              f"{r['activation_peak_GB']:>12.3f} {r['reserve_GB']:>10.2f}  step {r['eager_step_ms']:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
