"""What every benchmark writes: ``<name>.json`` (its rows with the command, device, date and versions), a text
table on stdout, and ``<name>.png`` when matplotlib is installed."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def _commit(root: Path | None = None) -> str | None:
    """The git commit of the ssmq source tree when it is a checkout, ``<hash>-dirty`` when its tracked files differ
    from that commit (the figures then come from code no commit holds), None for an installed wheel."""
    root = root or Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    if not commit:
        return None
    return commit + "-dirty" if changed.returncode == 0 and changed.stdout.strip() else commit


def provenance(device: torch.device) -> dict:
    """Where and when a result was measured: {"gpu", "date" (UTC), "commit"}."""
    return {"gpu": device_name(device), "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": _commit()}


def record(name: str, device: torch.device, argv: list[str] | None = None, **extra) -> dict:
    """The header of a result file: what ran, where and when."""
    from ssmq.version import __version__

    argv = sys.argv[1:] if argv is None else argv
    return {"benchmark": name, "command": "ssmq " + " ".join(argv), **provenance(device), "ssmq": __version__,
            "torch": torch.__version__, **extra, "rows": []}


def table(rows: list[dict], columns: list[str]) -> str:
    """A fixed-width text table of ``columns`` of ``rows`` (floats to 3 significant decimals)."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write(result: dict, out: str | Path | None, plot=None) -> list[Path]:
    """``result`` as ``<benchmark>.json`` in ``out`` and, with ``plot(pyplot, result, path)`` and matplotlib
    installed, ``<benchmark>.png``; returns the paths written (none without ``out``)."""
    if out is None:
        return []
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{result['benchmark']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    written = [path]
    if plot is not None and result["rows"]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib import pyplot
        except ImportError:
            print("note: matplotlib is not installed; no PNG written", file=sys.stderr)
            return written
        png = out / f"{result['benchmark']}.png"
        fig = plot(pyplot, result)
        fig.savefig(png, dpi=120, bbox_inches="tight")
        pyplot.close(fig)
        written.append(png)
    return written


def lines_plot(pyplot, result: dict, x: str, y: str, series: str, xlabel: str, ylabel: str, logx: bool = True):
    """One line of ``y`` against ``x`` per value of ``series``, titled with the benchmark and its device."""
    fig, ax = pyplot.subplots(figsize=(6, 4))
    groups: dict = {}
    for r in result["rows"]:
        if r.get(x) is not None and r.get(y) is not None:
            groups.setdefault(r[series], []).append((r[x], r[y]))
    for label, pts in groups.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(label))
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"ssmq bench {result['benchmark']} - {result['gpu']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return fig
