"""Side-by-side results of several models on the same data: one JSON, a Markdown table, a bar chart PNG.

The first model is the baseline: every other column shows its value and the delta against the first
(accuracies in percentage points, perplexities in absolute units). The PNG needs matplotlib; without it the chart is
skipped with a printed note.

    python -m ssmq.eval.report --compare fp16=MODEL w8a8=out/mamba2-w8a8 --tasks all --out cmp.json
"""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import torch

from ssmq.eval import suite
from ssmq.eval.loading import load_for_eval, parse_spec, resolve_device, resolve_dtype

PCT = {"acc", "acc_norm", "acc_bytes"} | {f"acc_{c}" for c in ("stem", "other", "social_sciences", "humanities")}


def table_rows(results: dict) -> list[tuple[str, str]]:
    """(task, metric) pairs to show, in task order: the task's reported metrics (headline first)."""
    from ssmq.eval.tasks import TASKS

    rows = []
    for task, r in results["results"].items():
        metrics = TASKS[task].metrics if task in TASKS else ("ppl",)
        rows += [(task, m) for m in metrics if m in r["metrics"]]
    return rows


def fmt(metric: str, v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    return f"{100 * v:.2f}" if metric in PCT else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def delta(metric: str, v: float, base: float) -> str:
    d = (v - base) * (100 if metric in PCT else 1)
    return f"{d:+.2f}"


def markdown(runs: list[tuple[str, dict]], deltas: bool = True) -> str:
    """Markdown table: one row per (task, metric), one column per model; deltas against the first model."""
    labels = [label for label, _ in runs]
    rows = table_rows(runs[0][1])
    lines = ["| task | metric | " + " | ".join(labels) + " |", "|---|---|" + "---:|" * len(labels)]
    for task, metric in rows:
        base = runs[0][1]["results"].get(task, {}).get("metrics", {}).get(metric)
        cells = []
        for i, (_, res) in enumerate(runs):
            v = res["results"].get(task, {}).get("metrics", {}).get(metric)
            cell = fmt(metric, v)
            if deltas and i and v is not None and base is not None:
                cell += f" ({delta(metric, v, base)})"
            cells.append(cell)
        unit = " (%)" if metric in PCT else ""
        lines.append(f"| {task} | {metric}{unit} | " + " | ".join(cells) + " |")
    s = runs[0][1]["setting"]
    lines.append("")
    lines.append(f"Setting: limit={s['limit']}, perplexity windows of {s['seqlen']} tokens, zero-shot max_length "
                 f"{s['max_length']}, batch size {s['batch_size']}; lm-eval 0.4.x task definitions "
                 f"(MMLU {s['mmlu_num_fewshot']}-shot)."
                 + (f" Deltas against {labels[0]}: accuracy in points, ppl absolute."
                    if deltas and len(runs) > 1 else ""))
    for label, res in runs:
        env = res.get("environment", {})
        where = env.get("gpu") or env.get("cpu") or ""
        lines.append(f"- {label}: {res.get('model', '')} ({res.get('dtype', '')}, {env.get('device', '')} {where}, "
                     f"{env.get('date', '')})")
    return "\n".join(lines) + "\n"


def bar_chart(runs: list[tuple[str, dict]], path: Path) -> bool:
    """Grouped bars of each task's headline metric (accuracies left, perplexities right). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped the chart {path}")
        return False
    heads = [(t, m) for t, m in table_rows(runs[0][1]) if m == suite.HEADLINE.get(t, "ppl")]
    groups = [[(t, m) for t, m in heads if m in PCT], [(t, m) for t, m in heads if m not in PCT]]
    groups = [g for g in groups if g]
    fig, axes = plt.subplots(1, len(groups), figsize=(6 + 3 * len(heads) * len(runs) / 8, 4), squeeze=False)
    width = 0.8 / len(runs)
    for ax, group in zip(axes[0], groups):
        for i, (label, res) in enumerate(runs):
            vals = [res["results"].get(t, {}).get("metrics", {}).get(m, float("nan")) for t, m in group]
            vals = [100 * v if m in PCT else v for (t, m), v in zip(group, vals)]
            ax.bar([j + i * width for j in range(len(group))], vals, width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(group))])
        ax.set_xticklabels([f"{t}\n{m}" for t, m in group], fontsize=8)
        ax.set_ylabel("accuracy (%)" if group[0][1] in PCT else "perplexity (lower is better)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(runs: list[tuple[str, dict]], out: str | Path) -> dict[str, Path]:
    """Write ``out`` (JSON), ``out.md`` and ``out.png`` beside it; returns the paths written."""
    out = Path(out)
    if out.suffix != ".json":
        out = out / "results.json" if out.is_dir() or not out.suffix else out.with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    baseline = runs[0][0]
    deltas = {}
    for label, res in runs[1:]:
        deltas[label] = {f"{t}/{m}": res["results"][t]["metrics"][m] - runs[0][1]["results"][t]["metrics"][m]
                         for t, m in table_rows(runs[0][1])
                         if t in res["results"] and m in res["results"][t]["metrics"]}
    doc = {"baseline": baseline, "models": [label for label, _ in runs], "runs": dict(runs), "deltas": deltas}
    out.write_text(json.dumps(doc, indent=2, default=float) + "\n")
    paths = {"json": out, "md": out.with_suffix(".md")}
    paths["md"].write_text(markdown(runs))
    if bar_chart(runs, out.with_suffix(".png")):
        paths["png"] = out.with_suffix(".png")
    return paths


def evaluate_spec(spec_str: str, task_names: list[str], quantized: str | None = None, dtype=None, device=None,
                  **kwargs) -> tuple[str, dict]:
    """Load one model spec, evaluate it, free it; returns (label, result with model/dtype/environment)."""
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    spec = parse_spec(spec_str, quantized)
    model, tokenizer = load_for_eval(spec, torch_dtype, device, tp_comm=kwargs.pop("tp_comm", None))
    try:
        res = suite.evaluate(model, tokenizer, task_names, **kwargs)
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res = {"model": spec.path + (f" + {spec.quantized}" if spec.quantized else ""), "backend": spec.backend,
           "dtype": str(torch_dtype).replace("torch.", ""), "environment": suite.environment(device), **res}
    return spec.label, res


def compare(specs: list[str], task_names: list[str], **kwargs) -> list[tuple[str, dict]]:
    """Evaluate every spec on the same tasks and data (see :func:`evaluate_spec`); labels are made unique."""
    runs: list[tuple[str, dict]] = []
    for s in specs:
        label, res = evaluate_spec(s, task_names, **kwargs)
        while label in {lbl for lbl, _ in runs}:
            label += "'"
        runs.append((label, res))
    return runs
