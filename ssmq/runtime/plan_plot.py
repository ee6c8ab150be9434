"""The PNG of ``ssmq plan``: GPU memory vs context at the plan's batch, one line per cache format, with the
--gpu-mem line; where a line crosses it is that format's longest context."""

from __future__ import annotations

from pathlib import Path

from ssmq.models.config import ModelConfig
from ssmq.runtime.plan import CacheFormat, Plan

GIB = 1024**3


def contexts(plan: Plan, formats: list[CacheFormat], cfg: ModelConfig) -> list[int]:
    """Powers of two from 256 to twice the longest context that fits in any format (at least 64k, at most 16M)."""
    from ssmq.runtime.plan import kv_bytes_per_token

    longest = 1 << 16
    for fmt in formats:
        kv = kv_bytes_per_token(cfg, fmt.kv)
        if kv and plan.budget > 0:
            longest = max(longest, int(plan.budget / plan.batch / kv))
    top = min(2 * longest, 1 << 24)
    return [1 << k for k in range(8, top.bit_length() + 1)]


def plot(plan: Plan, formats: list[CacheFormat], cfg: ModelConfig, path: Path) -> bool:
    """Write the chart to ``path``; False (and a printed note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed; skipped the plot {path}")
        return False
    xs = contexts(plan, formats, cfg)
    fig, ax = plt.subplots(figsize=(8, 5))
    for fmt in formats:
        ax.plot(xs, [plan.memory(plan.batch, x, cfg, fmt) / GIB for x in xs], marker=".", label=fmt.label(cfg))
    ax.axhline(plan.gpu_mem / GIB, color="black", linestyle="--", label=f"--gpu-mem {plan.gpu_mem / GIB:.1f} GiB")
    ax.axhline((plan.weights + plan.reserve) / GIB, color="gray", linestyle=":",
               label=f"weights + reserve {(plan.weights + plan.reserve) / GIB:.2f} GiB")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.5 * plan.gpu_mem / GIB)  # linear up to past the limit: the crossings are what matters
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("GPU memory (GiB)")
    ax.set_title(f"{plan.model} ({plan.arch}), batch {plan.batch}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
