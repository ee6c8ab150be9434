"""matplotlib for the benchmarks' PNGs, headless; a benchmark without it still writes its JSON and tables."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (saying so in one line) when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def log_axes(ax, xlabel: str, ylabel: str, title: str, ylog: bool = True, legend_size: int = 8) -> None:
    """The benchmarks' usual panel: x on a base-2 log scale (batch, context, L), y log (or linear), labels, legend."""
    ax.set_xscale("log", base=2)
    if ylog:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=legend_size)
