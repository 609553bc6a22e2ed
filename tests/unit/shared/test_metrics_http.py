"""The per-service Prometheus endpoint: own registry, ephemeral port reported next to the port file."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from stageserve.metrics_http import metrics_port_file, start_metrics_server


def test_ephemeral_port_is_written_next_to_the_port_file(tmp_path):
    registry = CollectorRegistry()
    Counter("stageserve_things", "things", registry=registry).inc(3)
    port = start_metrics_server(registry, "127.0.0.1", 0, tmp_path / "device.port")
    assert port and metrics_port_file(tmp_path / "device.port") == tmp_path / "device.metrics-port"
    assert int((tmp_path / "device.metrics-port").read_text()) == port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body = response.read().decode()
    assert "stageserve_things_total 3.0" in body
    assert "python_gc" not in body  # the service's own registry, not the process-global one
    for process_metric in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "python_info"):
        assert f"\n{process_metric}" in body


def test_off_serves_nothing(tmp_path):
    assert start_metrics_server(CollectorRegistry(), "127.0.0.1", None, tmp_path / "x.port") is None
    assert not (tmp_path / "x.metrics-port").exists()


def test_a_taken_port_names_the_flag():
    taken = start_metrics_server(CollectorRegistry(), "127.0.0.1", 0)
    with pytest.raises(RuntimeError, match="--metrics-port"):
        start_metrics_server(CollectorRegistry(), "127.0.0.1", taken)
