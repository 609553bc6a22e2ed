"""Medians of interleaved ``stageserve bench --json`` reports of two sides, and their ratio.

Usage: python3 benchmarks/side_by_side.py OUT BASE OTHER   (reads OUT/BASE-*.json and OUT/OTHER-*.json)
Used by the side-by-side scripts of this folder (http_vs_grpc.sh, secure_vs_plain.sh).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIGURES = (("output tokens/s", ("output_tokens_per_s",)), ("TTFT p50 ms", ("ttft_ms", "p50")),
           ("TTFT p99 ms", ("ttft_ms", "p99")), ("e2e p50 ms", ("e2e_ms", "p50")))


def runs(out: Path, side: str) -> list[dict]:
    """The ``stageserve bench --json`` reports ``out/<side>-*.json``, in name order."""
    return [json.loads(path.read_text()) for path in sorted(out.glob(f"{side}-*.json"))]


def median(reports: list[dict], keys: tuple[str, ...]) -> float:
    """The median over ``reports`` of the figure at the nested ``keys`` (e.g. ``("ttft_ms", "p50")``).

    Raises:
        KeyError: a report lacks the figure.
    """
    values = []
    for report in reports:
        for key in keys:
            report = report[key]
        values.append(report)
    return statistics.median(values)


def main(out: Path, base_name: str, other_name: str) -> None:
    base, other = runs(out, base_name), runs(out, other_name)
    print(f"{len(base)} runs each; medians; raw reports in {out}")
    ratio = f"{other_name}/{base_name}"
    print(f"{'':24}{base_name:>10}{other_name:>10}{ratio:>{max(11, len(ratio) + 2)}}")
    for label, keys in FIGURES:
        b, o = median(base, keys), median(other, keys)
        print(f"{label:24}{b:>10.1f}{o:>10.1f}{o / b:>{max(11, len(ratio) + 2)}.3f}")
    print(f"failed requests: {sum(report['requests']['failed'] for report in base + other)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
