"""``stageserve trace``: ``merge`` fragments, ``analyze`` a trace, ``plot`` a timeline.

Examples::

    stageserve trace merge traces/ -o trace.json
    stageserve trace analyze trace.json --warmup 5 -o report      # report.json, report.md
    stageserve trace plot trace.json -o timeline.png --steps 10:17
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_WARMUP_STEPS = 3


def _step_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        bounds = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps takes FIRST:LAST step ids, e.g. 10:17; got {text!r}") from None
    if bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"--steps FIRST must be <= LAST; got {text!r}")
    return bounds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``merge``, ``analyze`` and ``plot`` sub-commands and their flags."""
    sub = parser.add_subparsers(dest="trace_command", required=True, metavar="TRACE_COMMAND")

    merge = sub.add_parser("merge", help="merge the *.trace.json fragments of a folder into one trace")
    merge.add_argument("trace_dir", type=Path, help="folder the services wrote their fragments into")
    merge.add_argument("-o", "--output", type=Path, default=Path("trace.json"),
                       help="merged trace (default %(default)s)")

    analyze = sub.add_parser("analyze", help="per-step and per-request timing report of a trace")
    analyze.add_argument("trace", type=Path, help="merged trace file, or a folder of fragments")
    analyze.add_argument("--warmup", type=int, default=DEFAULT_WARMUP_STEPS,
                         help="leading steps left out of the steady statistics (default %(default)s)")
    analyze.add_argument("-o", "--output", type=Path, default=None,
                         help="report path stem: writes STEM.json and STEM.md (default: 'report' next to the trace)")

    plot = sub.add_parser("plot", help="timeline picture (needs matplotlib)")
    plot.add_argument("trace", type=Path, help="merged trace file, or a folder of fragments")
    plot.add_argument("-o", "--output", type=Path, default=Path("timeline.png"),
                      help="image file, format from its suffix (default %(default)s)")
    plot.add_argument("--steps", type=_step_range, default=None, metavar="FIRST:LAST",
                      help="zoom on these step ids (inclusive); default the whole trace")


def _merge(args: argparse.Namespace) -> int:
    from stageserve.trace_tools.merge import merge_dir

    out = merge_dir(args.trace_dir, args.output)
    print(f"merged trace written to {out} (open in https://ui.perfetto.dev)")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from stageserve.trace_tools.analyze import analyze, format_summary, load_events, write_report

    events, dropped = load_events(args.trace)
    report = analyze(events, warmup=args.warmup, dropped_events=dropped)
    report["trace"] = str(args.trace)
    stem = args.output
    if stem is None:
        stem = (args.trace if args.trace.is_dir() else args.trace.parent) / "report"
    elif stem.suffix in (".json", ".md"):
        stem = stem.with_suffix("")
    json_path, md_path = write_report(report, stem)
    print(format_summary(report))
    print(f"report written to {json_path} and {md_path}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from stageserve.trace_tools.analyze import load_events
    from stageserve.trace_tools.plot import plot_timeline

    events, _ = load_events(args.trace)
    try:
        out = plot_timeline(events, args.output, steps=args.steps)
    except ImportError as exc:
        raise ImportError(f"{exc}; plotting needs matplotlib: pip install matplotlib") from exc
    print(f"timeline written to {out}")
    return 0


COMMANDS = {"merge": _merge, "analyze": _analyze, "plot": _plot}


def run(args: argparse.Namespace) -> int:
    """Run the chosen trace sub-command; exit code 1 with a message on a bad or broken trace."""
    try:
        return COMMANDS[args.trace_command](args)
    except (ValueError, OSError, ImportError) as exc:  # TraceLifecycleError is a ValueError
        print(f"stageserve trace {args.trace_command}: error: {exc}", file=sys.stderr)
        return 1
