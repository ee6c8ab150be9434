"""The Quamba papers' story on our reference models, as tables (WikiText-2 perplexity, optional zero-shot).

    python benchmarks/run_quamba_table.py                      # GPU: both models, 64 x 512 calibration windows
    python benchmarks/run_quamba_table.py --full               # 512 x 512 calibration windows (the papers' size)
    python benchmarks/run_quamba_table.py --limit 2 --calib-samples 4 --device cpu   # CPU smoke run

Tables (per model):
  1. story     FP16 -> naive static W8A8 -> +Hadamard on y -> +percentile clipping (= Quamba)
               -> Quamba2 W8A8 / W4A8 / W4A16 / mixed (W4AX, evolutionary search; HC-first / HC-last baselines)
  2. ladder    Quamba2 W4A8 built one component at a time (which component buys what)
  3. state     8-bit SSM state cache: perplexity with chunked prefill through the cache (the state is
               quantized at every chunk boundary) and state bytes, vs the 16-bit cache
Quantized models run the float parts in float32 (fake-quantized activations, dequantized weights): the
numbers are those of the integer kernels, not their speed. Writes a JSON and a Markdown file to --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ssmq.eval.perplexity import perplexity_of_ids
from ssmq.quant import get_recipe, quantize
from ssmq.quant.recipe import Cache, Transform
from ssmq.quant.ssm.state_cache import allocate_cache, state_bytes

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- evaluation
def eval_windows(tok, seqlen: int, limit: int | None) -> torch.Tensor:
    """(n, seqlen) non-overlapping windows of WikiText-2 test, as ``ssmq eval`` cuts them."""
    from ssmq.eval.perplexity import windows, wikitext2_path

    return windows(tok.encode(wikitext2_path("test").read_text(encoding="utf-8")), seqlen, limit)


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int, chunk: int | None = None, ssm_dtype=None) -> float:
    """exp(mean NLL) over windows; with ``chunk``, each window is prefilled chunk by chunk through a cache."""
    if chunk is None:  # the eval package's definition
        return perplexity_of_ids(model, windows.reshape(-1).tolist(), windows.shape[1], batch_size,
                                 progress=False)["ppl"]
    dev = next(p for p in model.parameters() if p.is_floating_point()).device
    nll, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i:i + batch_size].to(dev)
        cache = allocate_cache(model, x.shape[0], x.shape[1], ssm_dtype=ssm_dtype)
        logits = torch.cat([model(x[:, t:t + chunk], cache=cache) for t in range(0, x.shape[1], chunk)], 1)
        nll += F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum").item()
        count += x[:, 1:].numel()
    return math.exp(nll / count)


# ---------------------------------------------------------------------------------------------- rows
def story_recipes(arch: str):
    """The Quamba ladder: quamba-w8a8 without percentile clipping, then without the Hadamard on y too."""
    quamba = get_recipe("quamba-w8a8")
    absmax_x = [dataclasses.replace(quamba.taps[0], observer="absmax"), *quamba.taps[1:]]
    hadamard_only = quamba.with_changes(name="+hadamard-y", taps=absmax_x)
    naive = hadamard_only.with_changes(name="naive-w8a8", transforms=[],
                                       description="naive static W8A8: per-tensor int8 linears and SSM inputs (absmax)")
    return [("naive static W8A8", naive), ("+ Hadamard on y", hadamard_only),
            ("+ percentile clipping (= Quamba)", quamba),
            ("Quamba2 W8A8", get_recipe("quamba2-w8a8")), ("Quamba2 W4A8", get_recipe("quamba2-w4a8")),
            ("Quamba2 W4A16", get_recipe("quamba2-w4a16")), ("Quamba2 mixed W4AX", get_recipe("quamba2-mixed"))]


def ladder_recipes():
    """Quamba2 W4A8 one component at a time (start: W4A8 RTN, per-tensor x, nothing else)."""
    full = get_recipe("quamba2-w4a8")
    rtn = [dataclasses.replace(r, weight=dataclasses.replace(r.weight, method="rtn")) for r in full.linears]
    base_taps = [copy.deepcopy(t) for t in full.taps]
    base_taps[0].layout, base_taps[1].layout = "per_tensor", "per_tensor"
    steps = [("W4A8 RTN g128, per-tensor x/B/C", dict(linears=rtn, taps=base_taps, transforms=[], embedding=None))]
    had = dict(steps[-1][1], transforms=[Transform("hadamard")])
    steps.append(("+ both-sides Hadamard", had))
    clu = copy.deepcopy(base_taps)
    clu[0].layout = "cluster"
    steps.append(("+ sort-and-cluster x (4x4)", dict(had, taps=clu, transforms=full.transforms)))
    sg = copy.deepcopy(clu)
    sg[1].layout = "state_group"
    steps.append(("+ per-state-group B/C", dict(steps[-1][1], taps=sg)))
    steps.append(("+ GPTQ", dict(steps[-1][1], linears=full.linears)))
    steps.append(("+ head-to-toe (= Quamba2 W4A8)", dict(steps[-1][1], embedding=full.embedding)))
    sg8 = copy.deepcopy(sg)
    sg8[1].state_groups = 4
    steps.append(("  variant: 4 state groups per B/C group", dict(steps[-1][1], taps=sg8)))
    return [(label, full.with_changes(name=f"ladder-{i}", **kw)) for i, (label, kw) in enumerate(steps)]


# ---------------------------------------------------------------------------------------------- main
def run_model(path: str, args, out: dict, save) -> None:
    """Fills ``out[path]`` row by row, calling ``save()`` after each so that a killed run keeps its rows."""
    import ssmq
    from ssmq.quant.calibration import load_calibration

    dev = args.device
    tok = ssmq.load_tokenizer(path)
    float_model = ssmq.load_model(path, dtype=torch.float32, device=dev).eval()
    arch = float_model.config.arch
    windows = eval_windows(tok, args.seqlen, args.limit)
    calib = load_calibration(None, args.calib_samples, args.calib_seqlen, seed=0, tokenizer=tok)
    res = {"arch": arch, "eval_windows": list(windows.shape), "calibration": calib.record(), "story": [],
           "ladder": [], "state": {}}
    out[path] = res

    def zero_shot(model):
        if not args.tasks:
            return None
        from ssmq.eval.suite import evaluate, headline, parse_tasks

        return headline(evaluate(model, tok, parse_tasks(args.tasks), limit=args.task_limit, progress=False))

    def measure(label, model, seconds=0.0, extra=None, zero_shot_too=True):
        row = {"label": label, "ppl": perplexity(model, windows, args.batch_size), "quantize_s": round(seconds, 1)}
        zs = zero_shot(model) if zero_shot_too else None
        if zs:
            row["zero_shot"] = zs
        row.update(extra or {})
        print(f"  {label:<40} ppl {row['ppl']:.3f}", flush=True)
        return row

    print(f"{path} ({arch})", flush=True)
    fp16 = copy.deepcopy(float_model).half() if dev != "cpu" else float_model
    res["story"].append(measure("FP16" if dev != "cpu" else "FP32 (CPU)", fp16))
    del fp16
    save()

    def quantized(recipe):
        t0 = time.perf_counter()
        m = quantize(copy.deepcopy(float_model), recipe, calib, batch_size=args.calib_batch, progress=False)
        return m, time.perf_counter() - t0

    sections = args.sections.split(",")
    for label, recipe in story_recipes(arch):
        is_mixed = recipe.search is not None
        if ("mixed" if is_mixed else "story") not in sections:
            continue
        m, s = quantized(recipe)
        res["story"].append(measure(label, m, s, {"mixed": m.quantization.get("mixed")}))
        del m
        save()
    if "state" in sections:  # 8-bit state cache, on Quamba2 W8A8
        m, _ = quantized(get_recipe("quamba2-w8a8").with_changes(name="quamba2-w8a8-state8", cache=Cache(state_bits=8)))
        st = {"chunk": args.state_chunk}
        for name, dtype in (("16-bit", torch.float16), ("8-bit", torch.int8)):
            st[name] = {"ppl": perplexity(m, windows, args.batch_size, args.state_chunk, dtype),
                        "state_bytes": state_bytes(allocate_cache(m, 1, args.seqlen, ssm_dtype=dtype))}
            print(f"  state cache {name}: ppl {st[name]['ppl']:.3f}, {st[name]['state_bytes']} bytes / sequence",
                  flush=True)
        res["state"] = st
        del m
        save()
    if "ladder" in sections:
        print("  ladder:", flush=True)
        for label, recipe in ladder_recipes():
            m, s = quantized(recipe)
            res["ladder"].append(measure(label, m, s, zero_shot_too=False))
            del m
            save()


def zero_shot_avg(row: dict) -> float | None:
    """Mean accuracy over the zero-shot tasks, in points (LAMBADA counts by its accuracy)."""
    zs = row.get("zero_shot")
    return 100 * sum(zs.values()) / len(zs) if zs else None


def markdown(out: dict, meta: dict) -> str:
    lines = [f"# Quamba / Quamba2 on the reference models ({meta['date']}, {meta['device']})", "",
             f"Command: `{meta['command']}`", ""]
    if meta.get("tasks"):
        lim = f"first {meta['task_limit']} examples of each" if meta.get("task_limit") else "all examples"
        lines += [f"Zero-shot ({lim}; story rows only): {meta['tasks']}. Accuracies in %, avg = their mean.", ""]
    for path, r in out.items():
        base = r["story"][0]["ppl"]
        base_zs = zero_shot_avg(r["story"][0])
        tasks = list(r["story"][0].get("zero_shot", {}))
        lines += [f"## {Path(path).name} ({r['arch']}), WikiText-2 test, {r['eval_windows'][0]} x {r['eval_windows'][1]} "
                  f"tokens; calibration {r['calibration']['n_samples']} x {r['calibration']['seqlen']}", "",
                  "| setting | ppl | vs FP16 | " + "".join(f"{t} | " for t in tasks) + ("avg | Δavg |" if tasks else ""),
                  "|---|---|---|" + "---|" * (len(tasks) + (2 if tasks else 0))]
        for table in ("story", "ladder"):
            if table == "ladder" and r["ladder"]:
                lines += ["| **Quamba2 W4A8 ladder** | | |" + " |" * (len(tasks) + (2 if tasks else 0))]
            for row in r[table]:
                cells = [row["label"], f"{row['ppl']:.3f}", f"{100 * (row['ppl'] / base - 1):+.2f}%"]
                if tasks:
                    zs, avg = row.get("zero_shot", {}), zero_shot_avg(row)
                    cells += [f"{100 * zs[t]:.1f}" if t in zs else "" for t in tasks]
                    cells += [f"{avg:.2f}", f"{avg - base_zs:+.2f}"] if avg is not None else ["", ""]
                lines.append("| " + " | ".join(cells) + " |")
        mixed = next((row["mixed"] for row in r["story"] if row.get("mixed")), None)
        if mixed:
            lines += ["", f"Mixed: assignment {mixed['assignment']}, held-out ppl {mixed['fitness_ppl']:.3f}; "
                          f"baselines {json.dumps({k: round(v, 3) for k, v in mixed['baselines_ppl'].items()})}"]
        s = r["state"]
        if s and "8-bit" in s:
            d = 100 * (s["8-bit"]["ppl"] / s["16-bit"]["ppl"] - 1)
            lines += ["", f"State cache (Quamba2 W8A8, prefill in chunks of {s['chunk']}): 16-bit ppl "
                          f"{s['16-bit']['ppl']:.3f}, 8-bit {s['8-bit']['ppl']:.3f} ({d:+.2f}%); bytes per sequence "
                          f"{s['16-bit']['state_bytes']} -> {s['8-bit']['state_bytes']}"]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    import sys

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=[str(ROOT.parent / "shared/models/mamba1"),
                                                   str(ROOT.parent / "shared/models/mamba2")])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqlen", type=int, default=2048, help="perplexity window")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N windows (smoke runs)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--calib-samples", type=int, default=64)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--calib-batch", type=int, default=8)
    p.add_argument("--full", action="store_true", help="512 x 512 calibration windows")
    p.add_argument("--tasks", default="", help="zero-shot tasks, e.g. lambada,hellaswag,piqa,arc_easy,arc_challenge,winogrande")
    p.add_argument("--task-limit", type=int, default=None)
    p.add_argument("--state-chunk", type=int, default=256)
    p.add_argument("--sections", default="story,mixed,state,ladder",
                   help="comma list, run in this order: story (FP16 ... Quamba2 W4A16), mixed (the W4AX search row), "
                        "state (8-bit state cache), ladder (Quamba2 W4A8 one component at a time; perplexity only)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quamba"))
    args = p.parse_args(argv)
    if args.full:
        args.calib_samples = 512
    torch.manual_seed(0)
    meta = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__, "tasks": args.tasks, "task_limit": args.task_limit}
    dst = Path(args.out)
    dst.mkdir(parents=True, exist_ok=True)
    out: dict = {}

    def save():
        (dst / "quamba_table.json").write_text(json.dumps({"meta": meta, "results": out}, indent=2, default=str))
        (dst / "quamba_table.md").write_text(markdown(out, meta))

    for path in args.models:
        run_model(path, args, out, save)
    print(f"wrote {dst / 'quamba_table.md'}")


if __name__ == "__main__":
    main()
