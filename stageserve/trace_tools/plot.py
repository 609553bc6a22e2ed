"""Timeline picture of a merged trace: one lane per service thread, steps coloured by ``step_id``.

The same step has the same colour in every lane, so prepare of step N+1, device work of step N
and reclaim of step N-1 overlapping in time are visible at a glance. matplotlib is an optional
dependency and is imported only when a plot is drawn.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from stageserve.trace_tools.analyze import TraceSpan, complete_spans

# Lanes of the pipeline's services first, in data-flow order; other processes after them.
SERVICE_ORDER = ("prepare", "device", "reclaim")
PALETTE = "tab20"  # 10 hues in a dark and a light shade
NO_STEP_COLOUR = "0.75"
MAX_LEGEND_STEPS = 20
LANE_HEIGHT = 0.8


def lane_names(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    """Process names by pid and thread names by (pid, tid), from the metadata events."""
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for event in events:
        if event.get("ph") != "M":
            continue
        name = (event.get("args") or {}).get("name")
        if event.get("name") == "process_name":
            processes[int(event["pid"])] = name
        elif event.get("name") == "thread_name":
            threads[(int(event["pid"]), int(event["tid"]))] = name
    return processes, threads


def step_colour_index(step_id: int) -> int:
    """tab20 index of a step: the 10 dark shades for 10 consecutive steps, then the light ones,
    so neighbouring steps never share a hue."""
    position = step_id % 20
    return 2 * position if position < 10 else 2 * (position - 10) + 1


def stack_depths(spans: list[TraceSpan]) -> list[int]:
    """Sub-row of each span (sorted by start) within its lane: nested or overlapping spans go one
    row down, as Perfetto draws a thread's slice stack."""
    row_ends: list[float] = []
    depths = []
    for span in spans:
        depth = next((d for d, end in enumerate(row_ends) if end <= span.start_us), len(row_ends))
        if depth == len(row_ends):
            row_ends.append(span.end_us)
        else:
            row_ends[depth] = span.end_us
        depths.append(depth)
    return depths


def select_steps(spans: list[TraceSpan], first_step: int, last_step: int) -> list[TraceSpan]:
    """Spans of steps ``first_step..last_step`` (inclusive), plus spans without ``step_id`` that
    overlap their time range.

    Raises:
        ValueError: no span has a step id in the range (the message names the range the trace has).
    """
    chosen = [s for s in spans if "step_id" in s.args and first_step <= int(s.args["step_id"]) <= last_step]
    if not chosen:
        step_ids = [int(s.args["step_id"]) for s in spans if "step_id" in s.args]
        present = f"this trace has step ids {min(step_ids)}..{max(step_ids)}" if step_ids else "this trace has no spans with a step_id"
        raise ValueError(f"no spans with step_id in {first_step}..{last_step}; {present}")
    start, end = min(s.start_us for s in chosen), max(s.end_us for s in chosen)
    return chosen + [s for s in spans if "step_id" not in s.args and s.end_us >= start and s.start_us <= end]


def plot_timeline(events: list[dict[str, Any]], out: Path, steps: tuple[int, int] | None = None,
                  title: str | None = None) -> Path:
    """Draw the complete events of ``events`` as a broken_barh timeline into ``out`` (PNG, SVG or
    PDF by suffix); returns ``out``.

    Args:
        events: Trace Event Format dicts of a merged trace.
        steps: ``(first, last)`` step ids to zoom on; default all spans.
        title: figure title; default names the step range.

    Raises:
        ValueError: no complete spans (in the chosen step range).
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    spans = complete_spans(events)
    if steps is not None:
        spans = select_steps(spans, *steps)
    if not spans:
        raise ValueError("the trace holds no complete (ph: X) spans to draw")
    processes, threads = lane_names(events)
    lanes: dict[tuple[int, int], list[TraceSpan]] = defaultdict(list)
    for span in spans:
        lanes[(span.pid, span.tid)].append(span)

    def lane_order(key: tuple[int, int]) -> tuple[int, str, int, int]:
        service = processes.get(key[0], str(key[0]))
        rank = SERVICE_ORDER.index(service) if service in SERVICE_ORDER else len(SERVICE_ORDER)
        return rank, service, key[0], key[1]

    ordered = sorted(lanes, key=lane_order)
    origin = min(s.start_us for s in spans)
    extent_ms = (max(s.end_us for s in spans) - origin) / 1000
    colours = colormaps[PALETTE]

    figure = Figure(figsize=(14, 1.5 + 0.55 * len(ordered)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    step_ids: set[int] = set()
    for row, key in enumerate(ordered):
        y = len(ordered) - 1 - row  # first lane on top
        depths = stack_depths(lanes[key])
        height = LANE_HEIGHT / (max(depths) + 1)
        for span, depth in zip(lanes[key], depths):
            step_id = span.args.get("step_id")
            colour = NO_STEP_COLOUR if step_id is None else colours(step_colour_index(int(step_id)))
            if step_id is not None:
                step_ids.add(int(step_id))
            start_ms, width_ms = (span.start_us - origin) / 1000, span.duration_us / 1000
            bottom = y + LANE_HEIGHT / 2 - (depth + 1) * height
            axes.broken_barh([(start_ms, max(width_ms, extent_ms * 1e-4))], (bottom, height),
                             facecolors=colour, edgecolor="black", linewidth=0.3)
            if width_ms > extent_ms * 0.04:  # label only bars wide enough to hold text
                axes.text(start_ms + width_ms / 2, bottom + height / 2, span.name.partition(".")[2] or span.name,
                          ha="center", va="center", fontsize=6, clip_on=True)
    axes.set_yticks(range(len(ordered)))
    axes.set_yticklabels([
        f"{processes.get(pid, pid)}: {threads.get((pid, tid), tid)}" for pid, tid in reversed(ordered)
    ])
    axes.set_xlabel("time (ms)")
    axes.set_xlim(0, extent_ms * 1.01)
    axes.grid(axis="x", linestyle=":", linewidth=0.5)
    shown = sorted(step_ids)[:MAX_LEGEND_STEPS]
    handles = [Patch(facecolor=colours(step_colour_index(s)), edgecolor="black", label=f"step {s}") for s in shown]
    if len(step_ids) > len(shown):
        handles.append(Patch(facecolor="white", label=f"... {len(step_ids) - len(shown)} more (colours repeat)"))
    if handles:
        axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)
    if title is None:
        title = "stageserve timeline" + (f", steps {steps[0]}..{steps[1]}" if steps else "")
    axes.set_title(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    return out
