"""The concurrency plot: output tokens/s and p99 ITL against concurrent streams, one line per system."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweep(series: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> Path:
    """Write a PNG of two panels (tokens/s; p99 ITL in ms, log scale) against concurrency (log2 axis) to ``path``.

    ``series`` maps a system's name to ``{concurrency: report}`` (reports of `build_report`).
    Raises ImportError when matplotlib is missing (it is in the ``test`` and ``bench`` extras).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (throughput, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in series.items():
        counts = sorted(points)
        if not counts:
            continue
        throughput.plot(counts, [points[c]["output_tokens_per_s"] for c in counts], marker="o", label=name)
        latency.plot(counts, [points[c]["itl_ms"]["p99"] for c in counts], marker="o", label=name)
    latency.set_yscale("log")  # stalls of seconds and steps of milliseconds on one panel
    for axis, label in ((throughput, "output tokens/s"), (latency, "p99 inter-token latency (ms, log scale)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent streams")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
