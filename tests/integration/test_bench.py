"""``stageserve bench`` against three real services on the simulated device, and the in-process
baseline on the same simulated device: report shape and counts (no timing assertions)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import grpc
import pytest

from stageserve.launcher import Pipeline
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch

SIM_ARGS = ["--backend", "sim", "--sim-step-ms", "2"]
OUTPUT_LEN = 16


@pytest.fixture(scope="module")
def sim_pipeline(tmp_path_factory: pytest.TempPathFactory):
    started = launch(tmp_path_factory, "pipeline-sim", device_args=SIM_ARGS)
    try:
        yield started
    finally:
        started.stop()


def test_bench_report_counts_add_up(sim_pipeline: Pipeline, tmp_path):
    report_path = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "stageserve", "bench", "--target", sim_pipeline.prepare.address, "--streams", "4",
         "--duration", "2", "--output-len", str(OUTPUT_LEN), "--input-len", "20", "--json", str(report_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "output tokens/s" in done.stdout and "done, 0 failed" in done.stderr  # table on stdout, progress on stderr
    report = json.loads(report_path.read_text())
    assert set(report) == {"schema", "config", "wall_s", "requests", "errors", "input_tokens", "output_tokens",
                           "requests_per_s", "output_tokens_per_s", "ttft_ms", "itl_ms", "e2e_ms"}
    requests = report["requests"]
    assert requests["ok"] == requests["sent"] >= 4 and requests["failed"] == 0 and report["errors"] == {}
    assert report["output_tokens"] == OUTPUT_LEN * requests["ok"]  # ignore_eos + max_tokens: fixed output
    assert report["input_tokens"] == 20 * requests["ok"]
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"} and report[key]["p50"] > 0
    assert report["config"]["streams"] == 4 and report["config"]["duration_s"] == 2


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stageserve", "bench", "--no-progress", *args], capture_output=True, text=True, timeout=120)


def test_json_to_stdout_is_only_json(sim_pipeline: Pipeline):
    done = run_bench("--target", sim_pipeline.prepare.address, "--streams", "2", "--requests", "4", "--output-len", "4", "--json", "-")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)  # the whole of stdout is the report
    assert report["requests"] == {"sent": 4, "ok": 4, "failed": 0}
    assert "output tokens/s" in done.stderr  # the table went to stderr


def test_every_request_failing_exits_non_zero():
    with socket.socket() as held:  # bound, not listening: every connection is refused
        held.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{held.getsockname()[1]}"
        done = run_bench("--target", target, "--streams", "2", "--requests", "4", "--json", "-")
    assert done.returncode == 1
    assert json.loads(done.stdout)["errors"] == {"UNAVAILABLE": 4}
    assert f"error: every request failed (UNAVAILABLE 4); is prepare running and ready at {target}?" in done.stderr


def test_inprocess_baseline_matches_the_services(sim_pipeline: Pipeline):
    """The same request through the in-process baseline (same sim device flags) and through the services."""
    from stageserve.bench.inprocess import InProcessPipeline
    from stageserve.model_files import embedded_model_path

    request = prepare_pb2.GenerateRequest(prompt="Hello there", max_tokens=OUTPUT_LEN, ignore_eos=True, temperature=0.0)
    with grpc.insecure_channel(sim_pipeline.prepare.address) as channel:
        served = prepare_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
    pipeline = InProcessPipeline(embedded_model_path(), [*SIM_ARGS, "--max-model-len", "256", "--kv-cache-memory", "256MiB"])
    try:
        chunks = pipeline.serve_while(lambda: list(pipeline.generate_stream(request)))
    finally:
        pipeline.close()
    assert [t for c in chunks for t in c.token_ids] == list(served.token_ids)
    assert "".join(c.text for c in chunks) == served.text
    assert chunks[-1].usage.completion_tokens == OUTPUT_LEN and chunks[-1].finish_reason == served.finish_reason
