"""Tracing, profiling, metrics and logs of three real service processes.

One async pipeline records from start-up (``--trace-dir``) while 8 streams run; its window is then
stopped through prepare's Admin service, merged and analyzed: every step is followed through the
three processes, and the device really submits step N+1 before step N's completion is observed.
A second window is started and stopped through prepare alone. A sync-dispatch pipeline writes its
window at shutdown and is labelled ``blocking_span``. Metrics are scraped after the traffic.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stageserve.launcher import Pipeline, ServiceProcess
from stageserve.trace_tools.analyze import analyze, complete_spans
from stageserve.trace_tools.merge import find_fragments, merge_fragments
from stageserve.v1 import admin_pb2, admin_pb2_grpc, prepare_pb2, prepare_pb2_grpc
from tests.grafana_dashboard import SCRAPE_LABELS, expressions, label_names, load_dashboard, metric_names
from tests.integration.conftest import launch

STREAMS = 8
MAX_TOKENS = 24
WARMUP_STEPS = 3


def run_streams(address: str, count: int, max_tokens: int, prefix: str) -> dict[str, int]:
    """``count`` concurrent greedy streams of exactly ``max_tokens`` tokens; request id -> tokens received."""
    received: dict[str, int] = {}
    errors: list[BaseException] = []

    def one(index: int) -> None:
        request_id = f"{prefix}-{index}"
        try:
            with grpc.insecure_channel(address) as channel:
                request = prepare_pb2.GenerateRequest(
                    request_id=request_id, prompt_token_ids=[1, 504 + index, 2000 + 7 * index, 9000 + index],
                    max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                )
                received[request_id] = sum(len(chunk.token_ids) for chunk in prepare_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=120))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return received


def scrape(process: ServiceProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)] from the service's /metrics endpoint."""
    assert process.metrics_port, f"{process.role} serves no metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    assert name in samples, f"{name} not exported; have {sorted(samples)}"
    return sum(value for sample_labels, value in samples[name] if labels.items() <= sample_labels.items())


def admin(pipeline: Pipeline) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(grpc.insecure_channel(pipeline.prepare.address))


def merged_events(trace_dir: Path) -> list[dict]:
    return merge_fragments(find_fragments(trace_dir))["traceEvents"]


def spans_by_service(events: list[dict]) -> dict[str, list]:
    """Complete spans grouped by the process name of their fragment."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    grouped: dict[str, list] = defaultdict(list)
    for span in complete_spans(events):
        grouped[names[span.pid]].append(span)
    return grouped


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory):
    """An async pipeline recording from start-up into ``trace_dir``; yields (pipeline, trace_dir)."""
    trace_dir = tmp_path_factory.mktemp("startup-trace")
    trace = ["--trace-dir", str(trace_dir)]
    started = launch(tmp_path_factory, "observability-async", device_args=trace, prepare_args=trace, reclaim_args=trace)
    try:
        yield started, trace_dir
    finally:
        started.stop()


@pytest.fixture(scope="module")
def workload(traced) -> dict[str, int]:
    """8 streams of 24 tokens through the traced pipeline, and its start-up window stopped (written)."""
    pipeline, _ = traced
    received = run_streams(pipeline.prepare.address, STREAMS, MAX_TOKENS, "obs")
    assert received == {f"obs-{i}": MAX_TOKENS for i in range(STREAMS)}
    return received


@pytest.fixture(scope="module")
def startup_window(traced, workload) -> tuple[admin_pb2.ProfileReply, list[dict]]:
    """StopProfile through prepare ends the start-up windows of all three; (reply, merged events)."""
    pipeline, trace_dir = traced
    reply = admin(pipeline).StopProfile(admin_pb2.StopProfileRequest(), timeout=30)
    return reply, merged_events(trace_dir)


def test_metrics_after_traffic(traced, workload):
    pipeline, _ = traced
    prepare = scrape(pipeline.prepare)
    assert metric(prepare, "stageserve_time_to_first_token_seconds_count") == STREAMS
    assert metric(prepare, "stageserve_e2e_request_latency_seconds_count") == STREAMS
    assert metric(prepare, "stageserve_request_queue_time_seconds_count") == STREAMS
    assert metric(prepare, "stageserve_requests_total", finish_reason="length", code="OK") == STREAMS
    # ITL: every token after the first of each stream is one gap
    assert metric(prepare, "stageserve_inter_token_latency_seconds_count") == STREAMS * (MAX_TOKENS - 1)
    assert metric(prepare, "stageserve_generation_tokens_total") == STREAMS * MAX_TOKENS
    assert metric(prepare, "stageserve_prompt_tokens_total") == STREAMS * 4
    assert metric(prepare, "stageserve_request_prefill_time_seconds_count") == STREAMS
    assert metric(prepare, "stageserve_request_decode_time_seconds_count") == STREAMS
    assert metric(prepare, "stageserve_kv_cache_blocks_used") == 0
    assert metric(prepare, "stageserve_kv_cache_blocks_free") > 0
    assert metric(prepare, "stageserve_kv_cache_usage_ratio") == 0
    assert metric(prepare, "stageserve_model_info", model_name="SmolLM2-135M-Instruct", backend="cpu", dtype="float32") == 1
    assert metric(prepare, "stageserve_requests_running") == 0
    assert metric(prepare, "stageserve_requests_waiting") == 0
    steps = metric(prepare, "stageserve_host_critical_path_seconds_count")
    assert steps >= MAX_TOKENS

    device = scrape(pipeline.device)
    assert metric(device, "stageserve_model_info", model_name="SmolLM2-135M-Instruct", backend="cpu", dtype="float32") == 1
    for scraped in (prepare, device):
        assert metric(scraped, "process_resident_memory_bytes") > 0 and metric(scraped, "process_open_fds") > 0
    assert metric(device, "stageserve_tickets_in_flight") == 0
    assert metric(device, "stageserve_steps_total", outcome="ok") == steps  # the warm-up step is not counted
    assert metric(device, "stageserve_step_device_time_seconds_count", timing_source="submit_to_completion") == steps
    assert metric(device, "stageserve_step_period_seconds_count") == steps - 1

    reclaim = scrape(pipeline.reclaim)
    assert metric(reclaim, "stageserve_steps_published_total", outcome="ok") == steps
    assert metric(reclaim, "stageserve_completion_wait_seconds_count") == steps
    assert metric(reclaim, "stageserve_requests_live") == 0


def test_grafana_dashboard_queries_only_metrics_the_services_export(traced, workload):
    """Every series and label the shipped dashboard queries exists on the live /metrics of the three services."""
    pipeline, _ = traced
    exported: dict[str, set[str]] = defaultdict(set)  # sample name -> label names seen on it
    for process in pipeline.processes:
        for name, samples in scrape(process).items():
            for labels, _ in samples:
                exported[name] |= set(labels)
    for title, expr in expressions(load_dashboard()):
        names = metric_names(expr)
        missing = names - set(exported)
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which no service exports"
        unknown = label_names(expr) - SCRAPE_LABELS - set().union(*(exported[name] for name in names))
        assert not unknown, f"panel {title!r} uses labels {sorted(unknown)} that {sorted(names)} do not carry"


def test_refused_request_is_counted_with_its_status(traced, workload):
    pipeline, _ = traced
    before = metric(scrape(pipeline.prepare), "stageserve_requests_total", finish_reason="error", code="INVALID_ARGUMENT")
    with grpc.insecure_channel(pipeline.prepare.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            prepare_pb2_grpc.GenerationStub(channel).Generate(prepare_pb2.GenerateRequest(prompt="hi", temperature=-1.0), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = metric(scrape(pipeline.prepare), "stageserve_requests_total", finish_reason="error", code="INVALID_ARGUMENT")
    assert after == before + 1


def test_every_step_is_followed_through_the_three_services(startup_window):
    reply, events = startup_window
    assert sorted(part.service for part in reply.services) == ["device", "prepare", "reclaim"]
    assert all(Path(part.trace_file).is_file() for part in reply.services)
    spans = spans_by_service(events)
    device_steps = {(int(s.args["step_id"]), int(s.args["ticket"])) for s in spans["device"] if s.name == "device.submit"}
    assert len(device_steps) >= MAX_TOKENS
    prepare_steps = defaultdict(set)
    for span in spans["prepare"]:
        if "step_id" in span.args:
            prepare_steps[int(span.args["step_id"])].add(span.name)
    reclaim_tickets = defaultdict(set)
    for span in spans["reclaim"]:
        if "ticket" in span.args:
            reclaim_tickets[int(span.args["ticket"])].add((span.name, int(span.args["step_id"])))
    device_names = defaultdict(set)
    for span in spans["device"]:
        if "step_id" in span.args:
            device_names[int(span.args["step_id"])].add(span.name)
    for step_id, ticket in device_steps:
        assert prepare_steps[step_id] == {"prepare.schedule", "prepare.build_plan", "prepare.send"}, step_id
        assert device_names[step_id] == {"device.upload", "device.submit", "device.wait", "device.copy_out"}, step_id
        assert {name for name, _ in reclaim_tickets[ticket]} == {"reclaim.ticket", "reclaim.wait", "reclaim.detokenize", "reclaim.publish"}, ticket
        assert {sid for _, sid in reclaim_tickets[ticket]} == {step_id}, ticket


def test_async_submit_overlaps_the_previous_completion(startup_window):
    _, events = startup_window
    report = analyze(events, warmup=WARMUP_STEPS)
    assert report["timing_source"] == "submit_to_completion"
    assert report["steps_steady"] >= MAX_TOKENS - WARMUP_STEPS
    # the device submitted step N+1 before step N's wait ended on most steady steps: the overlap is measured
    assert report["steady"]["pipelined_fraction_submit_to_completion"] > 0.5
    assert report["steady"]["batch_size"]["max"] == STREAMS
    assert report["requests"]["count"] == STREAMS
    assert report["requests"]["ttft_ms"]["n"] == STREAMS
    assert report["requests"]["itl_ms"]["n"] == STREAMS * (MAX_TOKENS - 1)


def test_start_and_stop_profile_through_prepare(traced, startup_window):
    pipeline, trace_dir = traced
    stub = admin(pipeline)
    with pytest.raises(grpc.RpcError) as outside:
        stub.StartProfile(admin_pb2.StartProfileRequest(name="../window"), timeout=30)
    assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (trace_dir.parent / "window").exists()
    with pytest.raises(grpc.RpcError) as idle:
        stub.StopProfile(admin_pb2.StopProfileRequest(), timeout=30)
    assert idle.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    window = trace_dir / "window"  # --profile-dir defaults to --trace-dir
    started = stub.StartProfile(admin_pb2.StartProfileRequest(name="window"), timeout=30)
    assert sorted(part.service for part in started.services) == ["device", "prepare", "reclaim"]
    with pytest.raises(grpc.RpcError) as twice:
        stub.StartProfile(admin_pb2.StartProfileRequest(name="window"), timeout=30)
    assert twice.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    run_streams(pipeline.prepare.address, 2, 6, "window")
    stopped = stub.StopProfile(admin_pb2.StopProfileRequest(), timeout=30)

    fragments = sorted(path.name.split("-")[0] for path in find_fragments(window))
    assert fragments == ["device", "prepare", "reclaim"]
    assert {Path(part.trace_file).parent for part in stopped.services} == {window}
    report = analyze(merged_events(window), warmup=0)
    assert report["steps_total"] >= 6
    assert report["requests"]["count"] == 2


def test_sync_dispatch_trace_is_labelled_blocking_span_and_logs_are_json(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("sync-trace")
    trace = ["--trace-dir", str(trace_dir)]
    pipeline = launch(tmp_path_factory, "observability-sync", device_args=["--dispatch", "sync", *trace],
                      prepare_args=[*trace, "--log-format", "json", "--log-level", "DEBUG"], reclaim_args=trace)
    try:
        run_streams(pipeline.prepare.address, 4, 8, "sync")
        device = scrape(pipeline.device)
        assert metric(device, "stageserve_step_device_time_seconds_count", timing_source="blocking_span") >= 8
        assert metric(device, "stageserve_step_device_time_seconds_count", timing_source="submit_to_completion") == 0
    finally:
        codes = pipeline.stop()
    assert codes == {"prepare": 0, "reclaim": 0, "device": 0}

    # the start-up windows were written at shutdown
    events = merged_events(trace_dir)
    report = analyze(events, warmup=2)
    assert report["timing_source"] == "blocking_span"
    assert "pipelined_fraction_submit_to_completion" not in report["steady"]
    assert report["steady"]["pipelined_fraction_blocking_span"] == 0.0
    names = {span.name for span in complete_spans(events)}
    assert "device.blocking_step" in names and "device.submit" not in names and "device.wait" not in names

    lines = [json.loads(line) for line in pipeline.prepare.log_path.read_text().splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "service", "logger", "message"} <= line.keys() for line in lines)
    assert {line["service"] for line in lines} == {"prepare"}
    about_requests = [line for line in lines if line.get("request_id", "").startswith("sync-")]
    assert {line["request_id"] for line in about_requests} == {f"sync-{i}" for i in range(4)}


def test_cancel_and_deadline_are_counted_apart(traced, startup_window):
    """A client cancel ends as ``abort``/``CANCELLED``, a passed deadline as ``abort``/``DEADLINE_EXCEEDED``."""
    pipeline, _ = traced  # after the start-up trace window is written, so these requests stay out of it

    def counts(code: str) -> float:
        return metric(scrape(pipeline.prepare), "stageserve_requests_total", finish_reason="abort", code=code)

    before = counts("CANCELLED"), counts("DEADLINE_EXCEEDED")
    request = prepare_pb2.GenerateRequest(prompt="Count to a hundred.", max_tokens=200, ignore_eos=True)
    with grpc.insecure_channel(pipeline.prepare.address) as channel:
        stub = prepare_pb2_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(request)
        next(stream)
        stream.cancel()
        with pytest.raises(grpc.RpcError) as late:
            list(stub.GenerateStream(request, timeout=0.25))  # 200 tokens take ~1 s on the fastest CPU seen (a Zen 5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 60
    while (counts("CANCELLED"), counts("DEADLINE_EXCEEDED")) != (before[0] + 1, before[1] + 1) and time.monotonic() < deadline:
        time.sleep(0.05)  # the handlers count their ends just after the client sees them
    assert (counts("CANCELLED"), counts("DEADLINE_EXCEEDED")) == (before[0] + 1, before[1] + 1)
