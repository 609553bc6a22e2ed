"""prepare's per-request observer: TTFT once, one ITL gap per token, exactly one terminal, trace events."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from stageserve.prepare.metrics import PrepareMetrics, RequestObserver
from stageserve.prepare.placement import DeviceLoad
from stageserve.tracing import Tracer, clock_ns
from stageserve.v1 import common_pb2, device_pb2, reclaim_pb2


def value(metrics: PrepareMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


@pytest.fixture
def metrics() -> PrepareMetrics:
    return PrepareMetrics(CollectorRegistry())


def event(tokens: int, finish=common_pb2.FINISH_REASON_UNSPECIFIED) -> reclaim_pb2.SequenceEvent:
    return reclaim_pb2.SequenceEvent(request_id="r", token_ids=list(range(tokens)), finish_reason=finish)


def test_ttft_itl_e2e_and_tokens(metrics):
    observer = RequestObserver(metrics, Tracer("prepare"), "r", clock_ns())
    observer.on_event(event(0))          # text-only / empty event: no token yet
    observer.on_event(event(1))          # first token -> TTFT
    observer.on_event(event(3))          # a chunk of 3 tokens -> 3 ITL gaps
    observer.on_event(event(1, common_pb2.FINISH_REASON_LENGTH))
    observer.on_client_gone()            # after the terminal: ignored
    assert value(metrics, "stageserve_time_to_first_token_seconds_count") == 1
    assert value(metrics, "stageserve_inter_token_latency_seconds_count") == 4
    assert value(metrics, "stageserve_generation_tokens_total") == 5
    assert value(metrics, "stageserve_e2e_request_latency_seconds_count") == 1
    assert value(metrics, "stageserve_requests_total", finish_reason="length", code="OK") == 1
    assert value(metrics, "stageserve_requests_total", finish_reason="abort", code="CANCELLED") == 0


def test_error_and_client_gone_are_counted_by_status(metrics):
    RequestObserver(metrics, Tracer("prepare"), "a", clock_ns()).on_error("UNAVAILABLE")
    RequestObserver(metrics, Tracer("prepare"), "b", clock_ns()).on_client_gone()
    assert value(metrics, "stageserve_requests_total", finish_reason="error", code="UNAVAILABLE") == 1
    assert value(metrics, "stageserve_requests_total", finish_reason="abort", code="CANCELLED") == 1
    assert value(metrics, "stageserve_e2e_request_latency_seconds_count") == 0
    assert value(metrics, "stageserve_time_to_first_token_seconds_count") == 0


def test_request_trace_events(metrics, tmp_path):
    tracer = Tracer("prepare")
    tracer.start(tmp_path)
    for name in ("request.ttft", "request.total"):
        tracer.begin_async(name, "r")
    observer = RequestObserver(metrics, tracer, "r", clock_ns())
    observer.on_event(event(2))
    observer.on_event(event(0, common_pb2.FINISH_REASON_STOP))
    events = json.loads(tracer.stop().read_text())["traceEvents"]
    timeline = [(e["ph"], e["name"], e.get("args", {})) for e in events if e["ph"] in "ben"]
    assert timeline[2:] == [("e", "request.ttft", {}), ("n", "request.token", {"tokens": 2}),
                            ("e", "request.total", {"finish_reason": "stop", "code": "OK"})]


def test_load_gauges_read_zero_without_a_device(metrics):
    load = [None]
    metrics.watch_engine(lambda: load[0])
    assert value(metrics, "stageserve_kv_cache_blocks_used") == 0
    load[0] = DeviceLoad(device_pb2.AttachReply(), running=3, waiting=2, kv_blocks_free=90, kv_blocks_total=100)
    assert value(metrics, "stageserve_kv_cache_blocks_used") == 10
    assert value(metrics, "stageserve_kv_cache_blocks_free") == 90
    assert value(metrics, "stageserve_requests_running") == 3
    assert value(metrics, "stageserve_requests_waiting") == 2


def test_kv_usage_fraction_and_model_info(metrics):
    load = [None]
    metrics.watch_engine(lambda: load[0])
    assert value(metrics, "stageserve_kv_cache_usage_ratio") == 0
    assert not [m for m in metrics.registry.collect() if m.name == "stageserve_model"]  # no device: no model
    attach = device_pb2.AttachReply(model_name="SmolLM2-135M-Instruct", backend="cpu", dtype="bfloat16")
    load[0] = DeviceLoad(attach, running=1, waiting=0, kv_blocks_free=75, kv_blocks_total=100)
    assert value(metrics, "stageserve_kv_cache_usage_ratio") == 0.25
    assert value(metrics, "stageserve_model_info", model_name="SmolLM2-135M-Instruct", backend="cpu", dtype="bfloat16") == 1


def test_prefill_and_decode_time_split_the_request_at_its_first_token(metrics):
    accepted = clock_ns() - 5_000_000  # accepted 5 ms ago, scheduled 1 ms after that
    observer = RequestObserver(metrics, Tracer("prepare"), "r", accepted)
    observer.on_scheduled(accepted + 1_000_000)
    observer.on_event(event(1))
    observer.on_event(event(2))
    observer.on_event(event(1, common_pb2.FINISH_REASON_STOP))
    assert value(metrics, "stageserve_request_prefill_time_seconds_count") == 1
    assert value(metrics, "stageserve_request_decode_time_seconds_count") == 1
    prefill = value(metrics, "stageserve_request_prefill_time_seconds_sum")
    decode = value(metrics, "stageserve_request_decode_time_seconds_sum")
    ttft = value(metrics, "stageserve_time_to_first_token_seconds_sum")
    e2e = value(metrics, "stageserve_e2e_request_latency_seconds_sum")
    assert 0 < prefill < ttft and prefill == pytest.approx(ttft - 0.001)  # queue 1 ms + prefill = TTFT
    assert decode == pytest.approx(e2e - ttft, abs=1e-3)
    failed = RequestObserver(metrics, Tracer("prepare"), "f", clock_ns())
    failed.on_scheduled(clock_ns())
    failed.on_error("UNAVAILABLE")  # no token, not finished: neither time is observed
    assert value(metrics, "stageserve_request_prefill_time_seconds_count") == 1
    assert value(metrics, "stageserve_request_decode_time_seconds_count") == 1
