"""Step and request figures from a merged trace (span names: see :mod:`stageserve.tracing`).

Per step (one completion ticket):

- **device time**, labelled by its timing source:
  ``submit_to_completion`` (async dispatch) = ``device.submit`` start -> end of the
  ``device.wait`` with the SAME ticket. Pairing is by ticket, never by order: with several steps
  in flight the n-th wait need not belong to the n-th submit in any recorded order.
  ``blocking_span`` (``--dispatch sync``) = duration of ``device.blocking_step``.
  The two sources are never mixed in one trace, nor reported under each other's label.
- **host time**: prepare (``prepare.schedule`` + ``build_plan`` + ``send``) plus reclaim
  (``reclaim.detokenize`` + ``publish``) spans carrying the step's ``step_id``.
- **period**: device start of this step -> device start of the next one.

Over the steady window (steps after ``warmup``): mean / median / p99 of those, the overlap ratio
(time the device had a step in flight / wall time) and the pipelined fraction (steps whose
successor was submitted before their completion was observed: the overlap is real).
Per request: queue time, TTFT, total latency and inter-token latencies from the ``request.*``
async events; speculative acceptance from ``accepted_tokens`` / ``draft_tokens`` args.

Steps cut by the trace window are tolerated only at its edges (completion order is submission
order, invariant 6): a submit with no wait after the last paired submit is still in flight; a wait
with no submit that ends before the first paired completion was submitted before the window.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from stageserve.trace_tools.merge import find_fragments, merge_fragments, read_events

ASYNC_SOURCE = "submit_to_completion"
BLOCKING_SOURCE = "blocking_span"

SUBMIT = "device.submit"
WAIT = "device.wait"
BLOCKING = "device.blocking_step"
PREPARE_SPANS = ("prepare.schedule", "prepare.build_plan", "prepare.send")
RECLAIM_SPANS = ("reclaim.detokenize", "reclaim.publish")
STEP_SIZE_ARGS = ("batch_size", "prefill_tokens", "decode_tokens")

# Float microseconds from ns/1000 may differ in the last bit; 1 ns is far below any real gap.
_EPSILON_US = 1e-3


class TraceLifecycleError(ValueError):
    """The trace breaks a step's lifecycle (wait before submit ended, a ticket with no or two
    waits, blocking and async spans mixed); ``ticket`` names the offending step."""

    def __init__(self, message: str, ticket: int | None) -> None:
        super().__init__(message)
        self.ticket = ticket


@dataclass(frozen=True)
class TraceSpan:
    """One complete event (``ph: X``); times in microseconds of ``CLOCK_MONOTONIC``."""

    name: str
    start_us: float
    end_us: float
    pid: int
    tid: int
    args: dict[str, Any]

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class StepTiming:
    """One step's figures; times in ms, ``start_ms``/``completion_ms`` relative to the trace origin.

    ``device_ms`` is submit-to-completion or the blocking span, as ``timing_source`` says.
    ``period_ms`` is None for the last step.
    """

    step_id: int
    ticket: int
    timing_source: str
    start_ms: float
    completion_ms: float
    device_ms: float
    prepare_ms: float
    reclaim_ms: float
    host_ms: float
    period_ms: float | None
    batch_size: int | None
    prefill_tokens: int | None
    decode_tokens: int | None


@dataclass
class RequestTiming:
    """One request's latencies in ms (None where its events fall outside the trace window)."""

    request_id: str
    queue_ms: float | None
    ttft_ms: float | None
    total_ms: float | None
    itl_ms: list[float]


def load_events(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Events of a merged trace file, or of every fragment of a trace folder; plus the number of
    events the tracers dropped at their cap.

    Raises:
        FileNotFoundError: no such file, or a folder without fragments.
        ValueError: not a trace.
    """
    if path.is_dir():
        document = merge_fragments(find_fragments(path))
        events, fragments = document["traceEvents"], document["otherData"]["fragments"]
    elif path.is_file():
        events, fragments = read_events(path)
    else:
        raise FileNotFoundError(f"trace {path} does not exist")
    return events, sum(int(info.get("dropped_events", 0)) for info in fragments)


def complete_spans(events: Iterable[dict[str, Any]]) -> list[TraceSpan]:
    """The complete events (``ph: X``) as :class:`TraceSpan`, sorted by start."""
    spans = [
        TraceSpan(e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
                  int(e.get("pid", 0)), int(e.get("tid", 0)), e.get("args") or {})
        for e in events if e.get("ph") == "X"
    ]
    spans.sort(key=lambda span: span.start_us)
    return spans


def _ticket_of(span: TraceSpan) -> int:
    ticket = span.args.get("ticket")
    if ticket is None:
        raise TraceLifecycleError(f"{span.name} span at ts={span.start_us:.3f} us has no 'ticket' arg", None)
    return int(ticket)


def _by_ticket(spans: list[TraceSpan], what: str) -> dict[int, TraceSpan]:
    """ticket -> its one span; a second span with the same ticket is a lifecycle error."""
    result: dict[int, TraceSpan] = {}
    for span in spans:
        ticket = _ticket_of(span)
        if ticket in result:
            raise TraceLifecycleError(f"ticket {ticket} has two {what} spans (at ts={result[ticket].start_us:.3f} "
                                      f"and ts={span.start_us:.3f} us); a ticket completes exactly once", ticket)
        result[ticket] = span
    return result


def device_intervals(spans: list[TraceSpan]) -> tuple[str, list[tuple[int, TraceSpan, float]]]:
    """Each complete step as ``(ticket, first device span, completion end in us)``, sorted by start,
    and the trace's timing source.

    Raises:
        TraceLifecycleError: blocking and async spans mixed; a ticket with two submits or two
            waits; a wait starting before its submit ended; a submit without wait (or wait without
            submit) that is not at the edge of the trace window.
        ValueError: device spans from more than one process, or no device spans at all.
    """
    submits = [s for s in spans if s.name == SUBMIT]
    waits = [s for s in spans if s.name == WAIT]
    blocking = [s for s in spans if s.name == BLOCKING]
    device_pids = {s.pid for s in submits + waits + blocking}
    if len(device_pids) > 1:
        raise ValueError(f"trace holds device spans of {len(device_pids)} processes {sorted(device_pids)}; "
                         "tickets are per device process, analyze one device at a time")
    if blocking and (submits or waits):
        offender = _ticket_of(blocking[0])
        other = _ticket_of((submits or waits)[0])
        raise TraceLifecycleError(
            f"trace mixes {BLOCKING} (ticket {offender}) with {SUBMIT}/{WAIT} spans (ticket {other}); "
            f"record one dispatch mode per trace", offender)
    if blocking:
        by_ticket = _by_ticket(blocking, BLOCKING)
        return BLOCKING_SOURCE, [(t, s, s.end_us) for t, s in sorted(by_ticket.items(), key=lambda i: i[1].start_us)]
    if not submits:
        raise ValueError(f"trace holds no {SUBMIT} or {BLOCKING} spans; was the device service traced?")

    submit_of = _by_ticket(submits, SUBMIT)
    wait_of = _by_ticket(waits, WAIT)
    paired = sorted(submit_of.keys() & wait_of.keys(), key=lambda t: submit_of[t].start_us)
    last_paired_submit = max((submit_of[t].start_us for t in paired), default=-math.inf)
    first_paired_completion = min((wait_of[t].end_us for t in paired), default=math.inf)
    for ticket in sorted(submit_of.keys() - wait_of.keys()):
        if submit_of[ticket].start_us < last_paired_submit:
            raise TraceLifecycleError(f"ticket {ticket} has no {WAIT} span although later-submitted steps "
                                      f"completed; its completion was never observed", ticket)
    for ticket in sorted(wait_of.keys() - submit_of.keys()):
        if wait_of[ticket].end_us > first_paired_completion:
            raise TraceLifecycleError(f"ticket {ticket} has a {WAIT} span but no {SUBMIT} span", ticket)
    for ticket in paired:
        submit, wait = submit_of[ticket], wait_of[ticket]
        if wait.start_us + _EPSILON_US < submit.end_us:
            raise TraceLifecycleError(
                f"ticket {ticket}: {WAIT} starts at ts={wait.start_us:.3f} us, before its {SUBMIT} ended at "
                f"ts={submit.end_us:.3f} us; a wait can only begin once the ticket exists", ticket)
    return ASYNC_SOURCE, [(t, submit_of[t], wait_of[t].end_us) for t in paired]


def step_timings(spans: list[TraceSpan], origin_us: float) -> tuple[str, list[StepTiming]]:
    """The trace's timing source and every complete step, in submission order.

    Raises:
        TraceLifecycleError, ValueError: see :func:`device_intervals`; also a device span
            without ``step_id``.
    """
    source, intervals = device_intervals(spans)
    prepare_us: dict[int, float] = defaultdict(float)
    reclaim_us: dict[int, float] = defaultdict(float)
    sizes: dict[int, dict[str, int]] = defaultdict(dict)
    for span in spans:
        step_id = span.args.get("step_id")
        if step_id is None:
            continue
        step_id = int(step_id)
        if span.name in PREPARE_SPANS:
            prepare_us[step_id] += span.duration_us
        elif span.name in RECLAIM_SPANS:
            reclaim_us[step_id] += span.duration_us
        for key in STEP_SIZE_ARGS:
            if key in span.args:
                sizes[step_id].setdefault(key, int(span.args[key]))

    steps = []
    for index, (ticket, first, completion_us) in enumerate(intervals):
        if "step_id" not in first.args:
            raise TraceLifecycleError(f"{first.name} span of ticket {ticket} has no 'step_id' arg", ticket)
        step_id = int(first.args["step_id"])
        next_start = intervals[index + 1][1].start_us if index + 1 < len(intervals) else None
        steps.append(StepTiming(
            step_id=step_id, ticket=ticket, timing_source=source,
            start_ms=(first.start_us - origin_us) / 1000, completion_ms=(completion_us - origin_us) / 1000,
            device_ms=(completion_us - first.start_us) / 1000,
            prepare_ms=prepare_us[step_id] / 1000, reclaim_ms=reclaim_us[step_id] / 1000,
            host_ms=(prepare_us[step_id] + reclaim_us[step_id]) / 1000,
            period_ms=None if next_start is None else (next_start - first.start_us) / 1000,
            **{key: sizes[step_id].get(key) for key in STEP_SIZE_ARGS},
        ))
    return source, steps


def pipelined_fraction(steps: list[StepTiming]) -> float | None:
    """Fraction of consecutive step pairs (N, N+1) where step N+1 started before step N's
    completion was observed; None for fewer than two steps.

    For async traces this is the evidence that submission really overlaps execution (near 1 when
    the pipeline is kept full); a correct ``--dispatch sync`` trace gives 0.
    """
    if len(steps) < 2:
        return None
    overlapped = sum(nxt.start_ms < cur.completion_ms for cur, nxt in zip(steps, steps[1:]))
    return overlapped / (len(steps) - 1)


def overlap_ratio(steps: list[StepTiming]) -> float | None:
    """Time covered by at least one step in flight (union of [start, completion]) divided by the
    wall time from the first start to the last completion; None without steps.

    Host-side observation: an upper bound of the accelerator's busy time.
    """
    if not steps:
        return None
    intervals = sorted((s.start_ms, s.completion_ms) for s in steps)
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    wall = max(s.completion_ms for s in steps) - intervals[0][0]
    return busy / wall if wall > 0 else None


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default ``linear`` method), ``q`` in [0, 100]."""
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize(values: Iterable[float | None]) -> dict[str, float] | None:
    """``{n, mean, median, p99, min, max}`` of the non-None values; None when there are none."""
    data = sorted(v for v in values if v is not None)
    if not data:
        return None
    return {"n": len(data), "mean": sum(data) / len(data), "median": percentile(data, 50),
            "p99": percentile(data, 99), "min": data[0], "max": data[-1]}


def request_timings(events: Iterable[dict[str, Any]]) -> tuple[list[RequestTiming], int]:
    """Per-request latencies from ``request.*`` async events, and how many async spans lacked
    their begin or end (cut by the window).

    ITL: gaps between consecutive ``request.token`` instants of a request; a chunk of k tokens
    (speculative decoding) contributes k entries of gap/k.
    """
    begins: dict[tuple[int, str, str], float] = {}
    durations: dict[str, dict[str, float]] = defaultdict(dict)
    chunks: dict[str, list[tuple[float, int]]] = defaultdict(list)
    unmatched = 0
    for event in sorted((e for e in events if e.get("ph") in ("b", "e", "n")), key=lambda e: e["ts"]):
        name, request_id, ts = event["name"], str(event.get("id")), float(event["ts"])
        key = (int(event.get("pid", 0)), name, request_id)
        if event["ph"] == "b":
            begins[key] = ts
        elif event["ph"] == "e":
            if key not in begins:
                unmatched += 1
                continue
            begin_ts = begins.pop(key)
            # A request that ended before its first token closes request.ttft with no_token: not a TTFT.
            if not (event.get("args") or {}).get("no_token"):
                durations[request_id][name] = (ts - begin_ts) / 1000
        elif name == "request.token":
            chunks[request_id].append((ts, int((event.get("args") or {}).get("tokens", 1))))
    unmatched += len(begins)
    requests = []
    for request_id in sorted(durations.keys() | chunks.keys()):
        itl: list[float] = []
        times = chunks.get(request_id, [])
        for (prev_ts, _), (ts, tokens) in zip(times, times[1:]):
            itl += [(ts - prev_ts) / 1000 / max(tokens, 1)] * max(tokens, 1)
        spans = durations.get(request_id, {})
        requests.append(RequestTiming(request_id, spans.get("request.queue"), spans.get("request.ttft"),
                                      spans.get("request.total"), itl))
    return requests, unmatched


def speculative_acceptance(spans: list[TraceSpan], step_ids: set[int]) -> dict[str, float] | None:
    """Acceptance over the given steps from the first span of each step carrying both
    ``accepted_tokens`` and ``draft_tokens``; None when no span carries them."""
    per_step: dict[int, tuple[int, int]] = {}
    for span in spans:
        step_id = span.args.get("step_id")
        if (step_id is not None and int(step_id) in step_ids and "accepted_tokens" in span.args
                and "draft_tokens" in span.args):
            per_step.setdefault(int(step_id), (int(span.args["accepted_tokens"]), int(span.args["draft_tokens"])))
    if not per_step:
        return None
    accepted = sum(a for a, _ in per_step.values())
    drafted = sum(d for _, d in per_step.values())
    return {"steps": len(per_step), "accepted_tokens": accepted, "draft_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_step": accepted / len(per_step)}


def analyze(events: list[dict[str, Any]], warmup: int = 0, dropped_events: int = 0) -> dict[str, Any]:
    """The full report (JSON-serializable dict) of a trace's events.

    Args:
        events: Trace Event Format dicts (merged trace of all services).
        warmup: leading steps (in submission order) left out of the steady statistics.
        dropped_events: events the tracers dropped at their cap (from the files' ``otherData``).

    Raises:
        TraceLifecycleError: see :func:`device_intervals`.
        ValueError: ``warmup`` < 0, or no device steps in the trace.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0 steps, got {warmup}")
    timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
    origin_us = min((float(e["ts"]) for e in timed), default=0.0)
    spans = complete_spans(timed)
    try:
        source, steps = step_timings(spans, origin_us)
    except TraceLifecycleError as exc:
        if dropped_events:
            raise TraceLifecycleError(f"{exc} (note: the tracers dropped {dropped_events} events at their cap, "
                                      f"raise max_events)", exc.ticket) from exc
        raise
    steady = steps[warmup:]
    warnings = []
    if dropped_events:
        warnings.append(f"{dropped_events} events were dropped at the tracer cap; figures may miss steps")
    if not steady:
        warnings.append(f"no steady steps: the trace has {len(steps)} complete steps and warmup is {warmup}")
    requests, unmatched = request_timings(timed)
    if unmatched:
        warnings.append(f"{unmatched} request spans were cut by the trace window and left out")
    device_key = f"{source}_ms"
    return {
        "timing_source": source,
        "warmup_steps": warmup,
        "steps_total": len(steps),
        "steps_steady": len(steady),
        "steady": {
            device_key: summarize(s.device_ms for s in steady),
            "host_ms": summarize(s.host_ms for s in steady),
            "prepare_ms": summarize(s.prepare_ms for s in steady),
            "reclaim_ms": summarize(s.reclaim_ms for s in steady),
            "period_ms": summarize(s.period_ms for s in steady),
            "batch_size": summarize(s.batch_size for s in steady),
            f"overlap_ratio_{source}": overlap_ratio(steady),
            f"pipelined_fraction_{source}": pipelined_fraction(steady),
        },
        "requests": {
            "count": len(requests),
            "queue_ms": summarize(r.queue_ms for r in requests),
            "ttft_ms": summarize(r.ttft_ms for r in requests),
            "itl_ms": summarize(gap for r in requests for gap in r.itl_ms),
            "total_ms": summarize(r.total_ms for r in requests),
            "per_request": [
                {"request_id": r.request_id, "queue_ms": r.queue_ms, "ttft_ms": r.ttft_ms, "total_ms": r.total_ms,
                 "itl_mean_ms": sum(r.itl_ms) / len(r.itl_ms) if r.itl_ms else None,
                 "tokens_after_first": len(r.itl_ms)}
                for r in requests
            ],
        },
        "speculative": speculative_acceptance(spans, {s.step_id for s in steady}),
        "steps": [_step_row(s) for s in steps],
        "dropped_events": dropped_events,
        "warnings": warnings,
    }


def _step_row(step: StepTiming) -> dict[str, Any]:
    """A step as a report row, its device time keyed by its timing source."""
    row = asdict(step)
    row[f"{step.timing_source}_ms"] = row.pop("device_ms")
    return row


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_summary(report: dict[str, Any]) -> str:
    """Markdown summary: steady step statistics, requests, speculative acceptance, warnings."""
    source = report["timing_source"]
    steady = report["steady"]
    lines = [
        "# stageserve trace report", "",
        f"Timing source: `{source}`. Steps: {report['steps_total']} complete, "
        f"{report['steps_steady']} steady after {report['warmup_steps']} warm-up.", "",
        "## Steady steps", "",
        "| figure | mean | median | p99 | n |", "|---|---|---|---|---|",
    ]
    labels = [(f"{source}_ms", f"device time, {source} (ms)"), ("host_ms", "host time on critical path (ms)"),
              ("prepare_ms", "  prepare (ms)"), ("reclaim_ms", "  reclaim (ms)"), ("period_ms", "step period (ms)"),
              ("batch_size", "batch size (rows)")]
    for key, label in labels:
        stats = steady[key]
        if stats is not None:
            lines.append(f"| {label} | {_fmt(stats['mean'])} | {_fmt(stats['median'])} | {_fmt(stats['p99'])} "
                         f"| {stats['n']} |")
    lines += ["", f"Overlap ratio ({source}, in-flight time / wall time): "
                  f"{_fmt(steady[f'overlap_ratio_{source}'])}",
              f"Pipelined fraction ({source}, step N+1 started before step N completed): "
              f"{_fmt(steady[f'pipelined_fraction_{source}'])}"]
    requests = report["requests"]
    if requests["count"]:
        lines += ["", "## Requests", "", f"{requests['count']} requests.", "",
                  "| latency (ms) | mean | median | p99 | n |", "|---|---|---|---|---|"]
        for key, label in (("queue_ms", "queue"), ("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("total_ms", "total")):
            stats = requests[key]
            if stats is not None:
                lines.append(f"| {label} | {_fmt(stats['mean'])} | {_fmt(stats['median'])} | {_fmt(stats['p99'])} "
                             f"| {stats['n']} |")
    spec = report["speculative"]
    if spec is not None:
        lines += ["", "## Speculative decoding", "",
                  f"Acceptance rate {_fmt(spec['acceptance_rate'])} ({spec['accepted_tokens']} of "
                  f"{spec['draft_tokens']} draft tokens over {spec['steps']} steady steps), "
                  f"{_fmt(spec['mean_accepted_per_step'])} accepted per step."]
    if report["warnings"]:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in report["warnings"]]
    return "\n".join(lines) + "\n"


def format_markdown(report: dict[str, Any]) -> str:
    """The summary plus one table row per step."""
    source = report["timing_source"]
    lines = ["", "## Steps", "",
             f"| step_id | ticket | start (ms) | {source} (ms) | host (ms) | period (ms) | batch |",
             "|---|---|---|---|---|---|---|"]
    for row in report["steps"]:
        lines.append(f"| {row['step_id']} | {row['ticket']} | {_fmt(row['start_ms'])} | {_fmt(row[f'{source}_ms'])} "
                     f"| {_fmt(row['host_ms'])} | {_fmt(row['period_ms'])} | {row['batch_size'] or '-'} |")
    return format_summary(report) + "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], stem: Path) -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.md``; returns both paths."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(format_markdown(report))
    return json_path, md_path
