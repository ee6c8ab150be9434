"""FP16 numbers of the reference models on every evaluation task, for the README (run on the GPU).

    python benchmarks/run_eval_suite.py --out results/eval_fp16            # all three models, all tasks, full data
    python benchmarks/run_eval_suite.py --limit 20 --models mamba2 --out /tmp/smoke   # quick check

For each model in ../shared/models/{mamba1,mamba2,hybrid}: WikiText-2 test perplexity (2048-token windows) and the
zero-shot suite (LAMBADA, HellaSwag, PIQA, ARC-Easy/Challenge, WinoGrande, MMLU 5-shot; lm-eval 0.4.x definitions).
Writes <out>/<model>.json and .md per model, <out>/all.json and <out>/all.md with every model side by side (no
deltas: different models), and prints that table. ``--backend hf`` evaluates the transformers implementation instead
(a cross-check of ssmq's models: the numbers should agree within fp16 noise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ssmq.errors import SSMQError  # noqa: E402
from ssmq.eval import report, suite  # noqa: E402
from ssmq.paths import shared_path  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mamba1,mamba2,hybrid", help="folders under ../shared/models")
    p.add_argument("--models-dir", help="default: ../shared/models")
    p.add_argument("--tasks", default="all")
    p.add_argument("--limit", type=int, help="first N documents per task (default: full data)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--ppl-batch-size", type=int, default=8)
    p.add_argument("--max-batch-tokens", type=int, default=65536, help="cap on padded tokens per forward")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", choices=["ssmq", "hf"], default="ssmq")
    p.add_argument("--out", default=f"results/eval_{time.strftime('%Y%m%d_%H%M')}")
    args = p.parse_args()

    models_dir = Path(args.models_dir) if args.models_dir else shared_path("models")
    if models_dir is None or not models_dir.is_dir():
        raise SSMQError("models folder not found: expected ../shared/models (or pass --models-dir)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task_names = suite.parse_tasks(args.tasks)
    runs = []
    for name in args.models.split(","):
        spec = f"{name}={'hf:' if args.backend == 'hf' else ''}{models_dir / name}"
        t0 = time.perf_counter()
        print(f"== {name} ({args.backend}, {args.dtype}, {args.device})", flush=True)
        label, res = report.evaluate_spec(spec, task_names, dtype=args.dtype, device=args.device, limit=args.limit,
                                          batch_size=args.batch_size, ppl_batch_size=args.ppl_batch_size,
                                          seqlen=args.seqlen, max_batch_tokens=args.max_batch_tokens)
        res["seconds_total"] = round(time.perf_counter() - t0, 1)
        report.write([(label, res)], out / f"{name}.json")
        print(report.markdown([(label, res)]), flush=True)
        runs.append((label, res))
    (out / "all.json").write_text(json.dumps(dict(runs), indent=2, default=float) + "\n")
    table = report.markdown(runs, deltas=False)
    times = ", ".join(f"{label} {res['seconds_total']} s" for label, res in runs)
    (out / "all.md").write_text(table + f"\nWall time: {times}.\n")
    print("\n" + table + f"\nWall time: {times}.\nwrote {out}/all.json, {out}/all.md")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SSMQError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
