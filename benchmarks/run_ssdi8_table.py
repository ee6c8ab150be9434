"""SSDi8 vs FP and Quamba2 on the reference models: WikiText-2 perplexity, the ablation, long context.

    python benchmarks/run_ssdi8_table.py --sections main,long --models ../shared/models/mamba2,../shared/models/hybrid
    python benchmarks/run_ssdi8_table.py --sections ablation --models ../shared/models/mamba2 --out R.json
    python benchmarks/run_ssdi8_table.py --calib-samples 512 --limit 144 --seqlen 2048   # the full size (GPU)
    python benchmarks/run_ssdi8_table.py --models M --save-inputs in.pt ...; ... --models M --inputs in.pt --device cuda

Sections:
  main      float, Quamba2 W8A8 / W4A8, SSDi8 W8A8 / W4A8 (hybrid: Quamba2 restricted to the Mamba layers'
            in_proj / out_proj and SSM taps, the SSD-only setting of SSDi8; Quamba2 itself is not defined for hybrids)
  ablation  SSDi8 W8A8 with one component changed per row
  long      perplexity of windows of 2k / 4k / 8k tokens for float, Quamba2 W8A8 and SSDi8 W8A8 (one prefill each)
Quantized models run the exact integer references in float32 (fake-quantized activations, dequantized weights).
Each row is written to --out as soon as it is measured.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from ssmq.eval.perplexity import perplexity_of_ids
from ssmq.quant.api import quantize as quantize_ssm
from ssmq.quant.recipe import Cache, Transform, get_recipe as get_ssm_recipe

ROOT = Path(__file__).resolve().parent.parent


def eval_windows(tok, seqlen: int, limit: int | None) -> torch.Tensor:
    from ssmq.eval.perplexity import wikitext2_path, windows

    return windows(tok.encode(wikitext2_path("test").read_text(encoding="utf-8")), seqlen, limit)


def ppl(model, windows: torch.Tensor) -> float:
    return perplexity_of_ids(model, windows.reshape(-1).tolist(), windows.shape[1], 1, progress=False)["ppl"]


def with_ssdi8(recipe, **params):
    """The recipe with the ssdi8 / mean_correction transform parameters changed (None: drop the transform)."""
    ts = []
    for t in recipe.transforms:
        if t.name in params:
            if params[t.name] is None:
                continue
            t = Transform(t.name, {**t.params, **params[t.name]})
        ts.append(t)
    return ts


def main_rows(arch: str):
    ssdi8 = [("SSDi8 W8A8", get_ssm_recipe("ssdi8-w8a8")), ("SSDi8 W4A8", get_ssm_recipe("ssdi8-w4a8"))]
    if arch == "hybrid":
        # the one recipe system applies only SSDi8's SSM transforms to hybrids (Recipe.validate), so the
        # "Quamba2 on the Mamba layers only" rows of earlier tables (quamba2_mamba_only) are not rebuilt here
        print("hybrid: Quamba2 rows skipped (Quamba2's SSM transforms are refused on hybrids)")
        return ssdi8
    return [("Quamba2 W8A8", get_ssm_recipe("quamba2-w8a8")), ("Quamba2 W4A8", get_ssm_recipe("quamba2-w4a8"))] + ssdi8


def ablation_rows():
    r = get_ssm_recipe("ssdi8-w8a8")
    row = lambda label, name, **kw: (label, r.with_changes(name=name, **kw))  # noqa: E731
    return [
        row("no reformulation (X quantized plainly, float chunk state)", "abl-noreform",
            transforms=with_ssdi8(r, ssdi8={"reformulate": False})),
        row("no persistent int8 state (float states, 16-bit cache)", "abl-floatstate", cache=Cache(state_bits=16),
            transforms=with_ssdi8(r, ssdi8={"int8_state": False, "int8_passing": False})),
        row("no int8 StatePassing (int8 states, decay in float)", "abl-floatpass",
            transforms=with_ssdi8(r, ssdi8={"int8_passing": False})),
        row("mean correction η = 0", "abl-eta0", transforms=with_ssdi8(r, mean_correction=None)),
        row("mean correction η = 1", "abl-eta1", transforms=with_ssdi8(r, mean_correction={"eta": 1.0})),
        row("γ migration only (no Hadamard)", "abl-gamma", transforms=with_ssdi8(r, hadamard=None)),
        row("no γ migration, no Hadamard", "abl-none", transforms=with_ssdi8(r, hadamard=None, gamma_migration=None)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="../shared/models/mamba2,../shared/models/hybrid")
    ap.add_argument("--sections", default="main,ablation,long")
    ap.add_argument("--calib-samples", type=int, default=512)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="evaluation windows (default: all)")
    ap.add_argument("--long", default="2048,4096,8192")
    ap.add_argument("--long-windows", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the models then run on the Triton kernels)")
    ap.add_argument("--save-inputs", default=None, help="write the token windows (evaluation, calibration, long) of "
                    "the one model in --models to this file and stop")
    ap.add_argument("--inputs", default=None, help="read the token windows from a --save-inputs file instead of "
                    "tokenizing (a device run then needs no tokenizer or text beside the weights)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/ssdi8_cpu.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import ssmq
    from ssmq.quant.calibration import CalibrationData, load_calibration

    out_path = Path(args.out)
    out = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "torch": torch.__version__, "args": vars(args), "models": {},
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    save = lambda: out_path.write_text(json.dumps(out, indent=2))  # noqa: E731
    sections = args.sections.split(",")
    for path in args.models.split(","):
        if args.inputs:
            saved = torch.load(args.inputs)
            ids = lambda t: t.long() + 32768  # noqa: E731  (stored as int16, shifted)
            win, long_windows = ids(saved["eval"]), {L: ids(w) for L, w in saved["long"].items()}
            calib = CalibrationData(ids(saved["calib"]), **saved["calib_record"])
        else:
            tok = ssmq.load_tokenizer(path)
            win = eval_windows(tok, args.seqlen, args.limit)
            long_windows = {L: eval_windows(tok, L, args.long_windows) for L in map(int, args.long.split(","))}
            calib = load_calibration(None, args.calib_samples, args.calib_seqlen, seed=0, tokenizer=tok)
        if args.save_inputs:  # int16 after a shift (ids < 2^16): a quarter of the bytes to carry
            rec = calib.record()
            i16 = lambda t: (t - 32768).to(torch.int16)  # noqa: E731
            torch.save({"eval": i16(win), "long": {L: i16(w) for L, w in long_windows.items()},
                        "calib": i16(calib.input_ids),
                        "calib_record": {"source": rec["source"], "seed": rec["seed"], "sha256": rec["sha256"]}},
                       args.save_inputs)
            print(f"wrote {args.save_inputs}")
            return
        fm = ssmq.load_model(path, dtype=torch.float32, device=args.device).eval()
        arch = fm.config.arch
        res = out["models"][path] = {"arch": arch, "eval_windows": list(win.shape), "calibration": calib.record(),
                                     "main": [], "ablation": [], "long": []}
        models = {"float32": fm}

        def measure(section, label, recipe=None):
            t0 = time.perf_counter()
            try:
                m = fm if recipe is None else quantize_ssm(copy.deepcopy(fm), recipe, calib, batch_size=4,
                                                           progress=False)
                qs = time.perf_counter() - t0
                row = {"label": label, "recipe": None if recipe is None else recipe.name, "ppl": ppl(m, win),
                       "quantize_s": round(qs, 1)}
            except Exception as e:  # noqa: BLE001 - a failing row is recorded, the table goes on
                res[section].append({"label": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                save()
                print(f"{path} {section:<9} {label:<60} FAILED {type(e).__name__}: {e}", flush=True)
                return None
            res[section].append(row)
            save()
            print(f"{path} {section:<9} {label:<60} ppl {row['ppl']:.3f}", flush=True)
            return m

        with torch.no_grad():
            if "main" in sections or "ablation" in sections:
                measure("main", f"float32 ({args.device})")
            if "main" in sections:
                for label, recipe in main_rows(arch):
                    m = measure("main", label, recipe)
                    if m is not None and label.endswith("W8A8") and "long" in sections:
                        models[label] = m
            if "ablation" in sections:
                for label, recipe in ablation_rows():
                    measure("ablation", label, recipe)
            if "long" in sections:
                for L, w in long_windows.items():
                    for label, m in models.items():
                        res["long"].append({"label": label, "seqlen": L, "windows": int(w.shape[0]), "ppl": ppl(m, w)})
                        save()
                        print(f"{path} long {L:>5} {label:<20} ppl {res['long'][-1]['ppl']:.3f}", flush=True)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
