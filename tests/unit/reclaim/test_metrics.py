"""reclaim's step observer: spans per device event, the ticket-held time as a histogram and as reclaim.wait spans on slot tracks."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from stageserve.reclaim.metrics import WAIT_TRACK_BASE, ReclaimMetrics, StepObserver
from stageserve.tracing import Tracer
from stageserve.v1 import device_pb2, reclaim_pb2


def test_overlapping_waits_go_on_one_track_per_slot(tmp_path):
    metrics, tracer = ReclaimMetrics(CollectorRegistry()), Tracer("reclaim")
    tracer.start(tmp_path)
    observer = StepObserver(metrics, tracer)
    arrivals = [
        (device_pb2.CompletionEvent(ticket=device_pb2.CompletionTicket(ticket=1, step_id=10, slot=0)), 1_000_000),
        (device_pb2.CompletionEvent(ticket=device_pb2.CompletionTicket(ticket=2, step_id=11, slot=1)), 2_000_000),
        (device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=1, step_id=10)), 5_000_000),
        (device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=2, step_id=11)), 9_000_000),
        (device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=3, step_id=12)), 9_500_000),  # no ticket seen
        (None, 9_600_000),  # a completion deadline passed: no span
    ]
    for event, now_ns in arrivals:
        with observer.handling(event, now_ns):
            pass
        observer.handled(event, now_ns)
    observer.published(reclaim_pb2.StepEvents(step_id=10))
    observer.published(reclaim_pb2.StepEvents(step_id=11, error_code=14))
    events = json.loads(tracer.stop().read_text())["traceEvents"]

    handled = [(e["name"], e["args"]["ticket"]) for e in events if e["name"] in ("reclaim.ticket", "reclaim.detokenize")]
    assert handled == [("reclaim.ticket", 1), ("reclaim.ticket", 2), ("reclaim.detokenize", 1), ("reclaim.detokenize", 2), ("reclaim.detokenize", 3)]
    waits = [(e["tid"], e["ts"], e["dur"], e["args"]["ticket"]) for e in events if e["name"] == "reclaim.wait"]
    assert waits == [(WAIT_TRACK_BASE, 1000.0, 4000.0, 1), (WAIT_TRACK_BASE + 1, 2000.0, 7000.0, 2)]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks[WAIT_TRACK_BASE + 1] == "reclaim.wait slot 1"
    registry = metrics.registry
    assert registry.get_sample_value("stageserve_completion_wait_seconds_count") == 2
    assert registry.get_sample_value("stageserve_completion_wait_seconds_sum") == pytest.approx(0.011)
    assert registry.get_sample_value("stageserve_host_critical_path_seconds_count") == 3  # one per output
    assert registry.get_sample_value("stageserve_steps_published_total", {"outcome": "ok"}) == 1
    assert registry.get_sample_value("stageserve_steps_published_total", {"outcome": "failed"}) == 1
