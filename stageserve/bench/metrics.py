"""Per-request timings of a benchmark run and the report made of them (dict for JSON, text table).

Definitions (times from ``time.perf_counter``, reported in ms):

- **TTFT**: request sent → first chunk that carries token ids.
- **ITL**: gap between consecutive token-carrying chunks of a request, spread evenly over the
  tokens of the later chunk (stageserve sends one chunk per step, so one gap per token).
- **e2e**: request sent → last message (final chunk or error status).
- **output tokens/s**: completion tokens of successful requests / wall time of the run (first
  request sent → last request ended); **requests/s** likewise.

Percentiles use linear interpolation between closest ranks (numpy's default ``linear`` method).
The report always has the same keys; a statistic without samples is ``null``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

REPORT_SCHEMA = "stageserve.bench/1"
STAT_KEYS = ("mean", "p50", "p90", "p99")


@dataclass
class RequestRecord:
    """What the client saw of one request.

    Attributes:
        sent_s: when it was sent.
        chunks: ``(arrival_s, token_count)`` of every chunk that carried token ids.
        ended_s: when its stream ended (finish or error).
        status: ``OK`` or the gRPC status code name.
        prompt_tokens, completion_tokens: from the final chunk's usage (0 when it failed).
    """

    sent_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    ended_s: float = 0.0
    status: str = "OK"
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.sent_s if self.chunks else None

    def itl_s(self) -> list[float]:
        gaps = []
        for (before, _), (after, count) in zip(self.chunks, self.chunks[1:]):
            gaps += [(after - before) / count] * count
        return gaps


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending ``sorted_values`` (non-empty), linear interpolation."""
    rank = (len(sorted_values) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of ``values_s`` (seconds) in ms; ``None`` each when empty."""
    if not values_s:
        return dict.fromkeys(STAT_KEYS)
    ordered = sorted(v * 1e3 for v in values_s)
    return {"mean": sum(ordered) / len(ordered), "p50": percentile(ordered, 50), "p90": percentile(ordered, 90), "p99": percentile(ordered, 99)}


def build_report(records: list[RequestRecord], config: dict[str, Any]) -> dict[str, Any]:
    """The JSON-shaped report of one run (see the module docstring); ``config`` is copied in as is."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.status] = errors.get(r.status, 0) + 1
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.ended_s for r in records), default=0.0)
    wall_s = max(end - start, 1e-9)
    output_tokens = sum(r.completion_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "schema": REPORT_SCHEMA,
        "config": config,
        "wall_s": wall_s,
        "requests": {"sent": len(records), "ok": len(ok), "failed": len(records) - len(ok)},
        "errors": dict(sorted(errors.items())),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(ok) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "ttft_ms": stats_ms([t for r in ok if (t := r.ttft_s()) is not None]),
        "itl_ms": stats_ms([gap for r in ok for gap in r.itl_s()]),
        "e2e_ms": stats_ms([r.ended_s - r.sent_s for r in ok]),
    }


def format_table(report: dict[str, Any]) -> str:
    """A fixed-layout text table of ``report`` (same rows every run, so runs diff cleanly)."""
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    requests = report["requests"]
    lines = [
        f"requests          {requests['ok']} ok / {requests['sent']} sent in {report['wall_s']:.2f} s",
        f"errors            {', '.join(f'{code} {n}' for code, n in report['errors'].items()) or 'none'}",
        f"requests/s        {report['requests_per_s']:.2f}",
        f"output tokens/s   {report['output_tokens_per_s']:.1f}  ({report['output_tokens']} tokens; {report['input_tokens']} input tokens)",
        f"{'(ms)':<17} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for key, label in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "e2e latency")):
        stats = report[key]
        lines.append(f"{label:<17} " + " ".join(f"{fmt(stats[k]):>9}" for k in STAT_KEYS))
    return "\n".join(lines)
