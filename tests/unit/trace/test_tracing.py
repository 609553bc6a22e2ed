"""Tracer: Perfetto fields, windows, cap, threads; merge of fragments from several processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stageserve.trace_tools.analyze import analyze, load_events
from stageserve.trace_tools.merge import find_fragments, merge_dir
from stageserve.tracing import Tracer, clock_ns


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _timed(document: dict) -> list[dict]:
    return [e for e in document["traceEvents"] if e["ph"] != "M"]


def test_disabled_tracer_records_nothing(tmp_path: Path) -> None:
    tracer = Tracer("device")
    assert not tracer.enabled
    span = tracer.span("device.submit", step_id=1)
    assert span is tracer.span("device.wait", step_id=2)  # one shared no-op object: no allocation per call
    with span as inside:
        inside.set(ticket=7)
    tracer.complete("device.wait", 0, 10, ticket=7)
    tracer.instant("prepare.admit")
    tracer.begin_async("request.total", "r1")
    tracer.end_async("request.total", "r1")
    tracer.instant_async("request.token", "r1", tokens=1)

    tracer.start(tmp_path)  # an empty window: only the process metadata
    document = _read(tracer.stop())
    assert _timed(document) == []
    assert document["traceEvents"] == [
        {"ph": "M", "name": "process_name", "pid": os.getpid(), "tid": 0, "args": {"name": "device"}}
    ]


def test_enabled_tracer_writes_perfetto_fields(tmp_path: Path) -> None:
    tracer = Tracer("device")
    tracer.start(tmp_path / "traces")
    before_us = clock_ns() / 1000
    with tracer.span("device.submit", step_id=np.int64(3), batch_size=4) as span:
        span.set(ticket=11)
    wait_start = clock_ns()
    tracer.complete("device.wait", wait_start, wait_start + 2_000_000, step_id=3, ticket=11)
    tracer.instant("device.slot_free", slot=1)
    tracer.begin_async("request.ttft", "req-a")
    tracer.instant_async("request.token", "req-a", tokens=2)
    tracer.end_async("request.ttft", "req-a")
    lane = 1_000_001
    tracer.name_lane(lane, "device stream")
    tracer.complete("device.compute", clock_ns(), clock_ns() + 1000, tid=lane, step_id=3)

    worker_tids = []

    def worker() -> None:
        worker_tids.append(threading.get_native_id())
        with tracer.span("device.copy_out", step_id=3, ticket=11):
            pass

    thread = threading.Thread(target=worker, name="completion-lane")
    thread.start()
    thread.join()
    after_us = clock_ns() / 1000
    path = tracer.stop()

    assert path == tmp_path / "traces" / f"device-{os.getpid()}.trace.json"
    document = _read(path)
    assert document["displayTimeUnit"] == "ms"
    assert document["otherData"]["clock"] == "CLOCK_MONOTONIC"
    assert document["otherData"]["dropped_events"] == 0
    events = _timed(document)
    assert [e["name"] for e in events] == [
        "device.submit", "device.wait", "device.slot_free", "request.ttft", "request.token", "request.ttft",
        "device.compute", "device.copy_out",
    ]
    for event in events:
        assert {"ph", "name", "cat", "ts", "pid", "tid", "args"} <= event.keys()
        assert event["pid"] == os.getpid()
        assert before_us <= event["ts"] <= after_us + 2000
    submit, wait, instant, begin, token, end, compute, copy_out = events
    assert submit["ph"] == "X" and submit["cat"] == "device" and submit["dur"] >= 0
    assert submit["args"] == {"step_id": 3, "batch_size": 4, "ticket": 11}  # numpy scalar -> JSON number
    assert submit["tid"] == threading.get_native_id()
    assert wait["dur"] == pytest.approx(2000.0)  # 2 ms in microseconds
    assert instant["ph"] == "i" and instant["s"] == "t"
    assert (begin["ph"], token["ph"], end["ph"]) == ("b", "n", "e")
    assert begin["id"] == token["id"] == end["id"] == "req-a" and begin["cat"] == "request"
    assert token["args"] == {"tokens": 2}
    assert compute["tid"] == lane
    assert copy_out["tid"] == worker_tids[0] != submit["tid"]
    thread_names = {e["tid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    assert thread_names[lane] == "device stream"
    assert thread_names[worker_tids[0]] == "completion-lane"
    assert thread_names[submit["tid"]] == threading.current_thread().name


def test_span_records_exception_and_reraises(tmp_path: Path) -> None:
    tracer = Tracer("reclaim")
    tracer.start(tmp_path)
    with pytest.raises(KeyError):
        with tracer.span("reclaim.detokenize", step_id=5):
            raise KeyError("boom")
    (event,) = _timed(_read(tracer.stop()))
    assert event["args"] == {"step_id": 5, "error": "KeyError"}


def test_cap_bounds_memory_and_counts_drops(tmp_path: Path) -> None:
    tracer = Tracer("prepare", max_events=5)
    tracer.start(tmp_path)
    for step in range(8):
        with tracer.span("prepare.schedule", step_id=step):
            pass
    assert tracer.dropped == 3
    document = _read(tracer.stop())
    assert [e["args"]["step_id"] for e in _timed(document)] == [0, 1, 2, 3, 4]
    assert document["otherData"]["dropped_events"] == 3


def test_repeated_windows_write_separate_files(tmp_path: Path) -> None:
    tracer = Tracer("device")
    tracer.start(tmp_path)
    tracer.instant("first")
    first = tracer.stop()
    tracer.instant("between windows")  # not recording: dropped silently, not counted
    tracer.start(tmp_path)
    tracer.instant("second")
    second = tracer.stop()
    assert first.name == f"device-{os.getpid()}.trace.json"
    assert second.name == f"device-{os.getpid()}-w2.trace.json"
    assert [e["name"] for e in _timed(_read(first))] == ["first"]
    assert [e["name"] for e in _timed(_read(second))] == ["second"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_start_stop_misuse_raises(tmp_path: Path) -> None:
    tracer = Tracer("device")
    with pytest.raises(RuntimeError, match="not recording"):
        tracer.stop()
    tracer.start(tmp_path)
    with pytest.raises(RuntimeError, match="already recording"):
        tracer.start(tmp_path)
    tracer.stop()
    with pytest.raises(ValueError, match="max_events"):
        Tracer("device", max_events=0)


def test_concurrent_recording_loses_nothing(tmp_path: Path) -> None:
    tracer = Tracer("reclaim")
    tracer.start(tmp_path)

    def record(worker: int) -> None:
        for step in range(500):
            with tracer.span("reclaim.publish", step_id=step, worker=worker):
                pass

    threads = [threading.Thread(target=record, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    events = _timed(_read(tracer.stop()))
    assert len(events) == 2000
    assert len({e["tid"] for e in events}) == 4


# A second process records its half of a step; the clocks must line up without any offset.
_CHILD = """
import sys
from stageserve.tracing import Tracer
tracer = Tracer("reclaim")
tracer.start(sys.argv[1])
with tracer.span("reclaim.detokenize", step_id=1):
    pass
with tracer.span("reclaim.publish", step_id=1):
    pass
tracer.stop()
"""


def test_merge_combines_fragments_of_several_processes(tmp_path: Path) -> None:
    trace_dir = tmp_path / "traces"
    device = Tracer("device")
    device.start(trace_dir)
    submit_start = clock_ns()
    device.complete("device.submit", submit_start, submit_start + 1000, step_id=1, ticket=1)
    subprocess.run([sys.executable, "-c", _CHILD, str(trace_dir)], check=True, timeout=60)
    wait_end = clock_ns()
    device.complete("device.wait", submit_start + 2000, wait_end, step_id=1, ticket=1)
    device.stop()

    fragments = find_fragments(trace_dir)
    assert len(fragments) == 2
    out = merge_dir(trace_dir, trace_dir / "merged.trace.json")
    assert find_fragments(trace_dir, exclude=out) == fragments  # re-merging skips its own output
    document = _read(out)
    metadata = [e for e in document["traceEvents"] if e["ph"] == "M"]
    timed = _timed(document)
    assert document["traceEvents"][: len(metadata)] == metadata  # metadata first
    assert {e["args"]["name"] for e in metadata if e["name"] == "process_name"} == {"device", "reclaim"}
    assert [e["ts"] for e in timed] == sorted(e["ts"] for e in timed)
    assert [e["name"] for e in timed] == ["device.submit", "device.wait", "reclaim.detokenize", "reclaim.publish"]
    child_pid = next(e["pid"] for e in timed if e["name"] == "reclaim.publish")
    assert child_pid != os.getpid()
    # The child ran between the parent's two clock reads: one host clock for both processes.
    for event in timed[2:]:
        assert submit_start / 1000 <= event["ts"] <= wait_end / 1000
    assert {f["service"] for f in document["otherData"]["fragments"]} == {"device", "reclaim"}

    events, dropped = load_events(out)
    report = analyze(events, warmup=0, dropped_events=dropped)
    (step,) = report["steps"]
    assert step["submit_to_completion_ms"] == pytest.approx((wait_end - submit_start) / 1e6, abs=1e-5)
    assert step["reclaim_ms"] > 0


def test_merge_without_fragments_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json fragments"):
        merge_dir(tmp_path, tmp_path / "trace.json")


def test_disabled_span_is_cheap() -> None:
    """Smoke bound, far above the measured ~0.2 us, so a loaded CI box does not flake."""
    tracer = Tracer("device")
    n = 20_000
    start = time.perf_counter_ns()
    for step in range(n):
        with tracer.span("device.submit", step_id=step, ticket=step):
            pass
    assert (time.perf_counter_ns() - start) / n < 5_000
