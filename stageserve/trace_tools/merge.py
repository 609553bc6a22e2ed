"""Merge the per-process trace fragments of a folder into one Perfetto-loadable trace.

Each service's :class:`stageserve.tracing.Tracer` writes ``<service>-<pid>[-wN].trace.json``; all
use ``CLOCK_MONOTONIC``, so merging is a concatenation sorted by ``ts`` with no clock shift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stageserve.tracing import FRAGMENT_SUFFIX


def find_fragments(trace_dir: Path, exclude: Path | None = None) -> list[Path]:
    """The ``*.trace.json`` files directly in ``trace_dir``, sorted by name, minus ``exclude``.

    Raises:
        FileNotFoundError: ``trace_dir`` is not a folder or holds no fragment.
    """
    if not trace_dir.is_dir():
        raise FileNotFoundError(f"trace folder {trace_dir} does not exist")
    skip = exclude.resolve() if exclude is not None else None
    fragments = sorted(p for p in trace_dir.glob(f"*{FRAGMENT_SUFFIX}") if p.resolve() != skip)
    if not fragments:
        raise FileNotFoundError(f"no *{FRAGMENT_SUFFIX} fragments in {trace_dir}; was tracing started and stopped?")
    return fragments


def read_events(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One trace file's events and its fragment descriptions (``otherData`` of each fragment).

    Accepts both Trace Event Format shapes: an object with ``traceEvents`` or a bare array.

    Raises:
        ValueError: the file is not JSON or not a trace.
    """
    try:
        document = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if isinstance(document, list):
        return document, []
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace: expected an object with a 'traceEvents' array")
    other = document.get("otherData") or {}
    fragments = other.get("fragments") if "fragments" in other else ([other] if other else [])
    return document["traceEvents"], fragments


def merge_fragments(paths: list[Path]) -> dict[str, Any]:
    """One trace document from several fragments: metadata events first (deduplicated), then all
    other events sorted by ``ts`` (stable, so equal timestamps keep their recorded order).

    ``otherData.fragments`` lists each fragment's own ``otherData`` plus its file name, so dropped
    event counts survive the merge.
    """
    metadata: list[dict[str, Any]] = []
    seen_metadata: set[str] = set()
    timed: list[dict[str, Any]] = []
    fragments: list[dict[str, Any]] = []
    for path in paths:
        events, infos = read_events(path)
        fragments += [{**info, "file": path.name} for info in infos]
        for event in events:
            if event.get("ph") == "M":
                key = json.dumps(event, sort_keys=True)
                if key not in seen_metadata:
                    seen_metadata.add(key)
                    metadata.append(event)
            else:
                timed.append(event)
    timed.sort(key=lambda event: event.get("ts", 0.0))
    return {"traceEvents": metadata + timed, "displayTimeUnit": "ms", "otherData": {"fragments": fragments}}


def merge_dir(trace_dir: Path, out: Path) -> Path:
    """Merge every fragment of ``trace_dir`` into ``out`` (which may lie in that folder).

    Raises:
        FileNotFoundError: no fragment found.
        ValueError: a fragment is not a valid trace.
    """
    document = merge_fragments(find_fragments(trace_dir, exclude=out))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document))
    return out
