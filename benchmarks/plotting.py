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
