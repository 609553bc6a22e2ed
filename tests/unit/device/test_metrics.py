"""The device's metrics: warm-up left out, device time labelled by its timing source."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from stageserve.device.step_ticket import StepResult
from stageserve.device.metrics import DeviceMetrics

RESULT = StepResult(token_ids=[1], logprobs=None, completed_unix_ns=0)  # a step's output; its contents are not measured


def ticket(submitted_ns: int, rows: int = 4) -> SimpleNamespace:
    """The two fields the metrics read of a StepTicket."""
    return SimpleNamespace(submitted_unix_ns=submitted_ns, admitted=SimpleNamespace(step=SimpleNamespace(sampled_seq_index=list(range(rows)))))


def sample(metrics: DeviceMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_steps_before_start_are_not_measured_and_periods_pair_submits():
    metrics = DeviceMetrics(CollectorRegistry(), "async")
    warm_up = ticket(time.time_ns())
    metrics.on_ticket(warm_up)
    metrics.on_output(warm_up, RESULT, None)
    metrics.start()
    now = time.time_ns()
    first, second = ticket(now - 30_000_000), ticket(now - 10_000_000, rows=8)
    metrics.on_ticket(first)
    metrics.on_ticket(second)
    metrics.on_output(first, RESULT, None)
    metrics.on_output(second, None, RuntimeError("device fault"))
    assert sample(metrics, "stageserve_step_period_seconds_count") == 1
    assert sample(metrics, "stageserve_step_period_seconds_sum") == pytest.approx(0.02)
    assert sample(metrics, "stageserve_step_batch_size_sum") == 12
    assert sample(metrics, "stageserve_steps_total", outcome="ok") == 1
    assert sample(metrics, "stageserve_steps_total", outcome="failed") == 1
    assert sample(metrics, "stageserve_step_device_time_seconds_count", timing_source="submit_to_completion") == 2
    assert sample(metrics, "stageserve_step_device_time_seconds_sum", timing_source="submit_to_completion") >= 0.04


def test_sync_dispatch_is_labelled_blocking_span_and_in_flight_is_read_at_scrape():
    metrics = DeviceMetrics(CollectorRegistry(), "sync")
    metrics.watch_in_flight(lambda: 2)
    metrics.start()
    step = ticket(time.time_ns())
    metrics.on_ticket(step)
    metrics.on_output(step, RESULT, None)
    assert sample(metrics, "stageserve_step_device_time_seconds_count", timing_source="blocking_span") == 1
    assert sample(metrics, "stageserve_step_device_time_seconds_count", timing_source="submit_to_completion") == 0
    assert sample(metrics, "stageserve_tickets_in_flight") == 2


def test_the_served_model_is_an_info_metric():
    metrics = DeviceMetrics(CollectorRegistry(), "async")
    metrics.describe_model("SmolLM2-135M-Instruct", "cpu", "bfloat16")
    assert sample(metrics, "stageserve_model_info", model_name="SmolLM2-135M-Instruct", backend="cpu", dtype="bfloat16") == 1
