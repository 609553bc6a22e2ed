"""``stageserve.v1.Admin``: profile windows started and stopped on one service and forwarded to peers.

Three in-process gRPC servers stand for prepare (forwarding) and its two peers.
"""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from stageserve.profiling import ProfileServicer
from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2, admin_pb2_grpc


def serve(servicer: ProfileServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    admin_pb2_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def deployment():
    """(prepare stub, {service: tracer}) with prepare forwarding to device and reclaim."""
    tracers = {name: Tracer(name) for name in ("prepare", "device", "reclaim")}
    servers = []
    peers = {}
    for name in ("device", "reclaim"):
        server, address = serve(ProfileServicer(tracers[name]))
        servers.append(server)
        peers[name] = address
    server, address = serve(ProfileServicer(tracers["prepare"], peers))
    servers.append(server)
    channel = grpc.insecure_channel(address)
    try:
        yield admin_pb2_grpc.AdminStub(channel), tracers, peers
    finally:
        channel.close()
        for server in servers:
            server.stop(0)


def test_one_call_profiles_all_three(deployment, tmp_path):
    stub, tracers, peers = deployment
    started = stub.StartProfile(admin_pb2.StartProfileRequest(trace_dir=str(tmp_path)))
    assert [(p.service, p.address) for p in started.services] == [("prepare", ""), ("device", peers["device"]), ("reclaim", peers["reclaim"])]
    assert all(tracer.enabled for tracer in tracers.values())
    for name, tracer in tracers.items():
        with tracer.span(f"{name}.work", step_id=1):
            pass
    stopped = stub.StopProfile(admin_pb2.StopProfileRequest())
    assert not any(tracer.enabled for tracer in tracers.values())
    for part in stopped.services:
        events = json.loads(open(part.trace_file).read())["traceEvents"]
        assert [e["name"] for e in events if e["ph"] == "X"] == [f"{part.service}.work"]


def test_local_only_leaves_the_peers_alone(deployment, tmp_path):
    stub, tracers, _ = deployment
    stub.StartProfile(admin_pb2.StartProfileRequest(trace_dir=str(tmp_path), local_only=True))
    assert [t.enabled for t in tracers.values()] == [True, False, False]
    reply = stub.StopProfile(admin_pb2.StopProfileRequest(local_only=True))
    assert [p.service for p in reply.services] == ["prepare"]


def test_a_failing_peer_is_named_and_nothing_is_left_recording(deployment, tmp_path):
    stub, tracers, peers = deployment
    tracers["reclaim"].start(tmp_path / "other")  # reclaim refuses: already recording
    with pytest.raises(grpc.RpcError) as failed:
        stub.StartProfile(admin_pb2.StartProfileRequest(trace_dir=str(tmp_path)))
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"reclaim at {peers['reclaim']}" in failed.value.details()
    assert not tracers["prepare"].enabled and not tracers["device"].enabled  # the call's own windows were undone
    assert tracers["reclaim"].enabled  # the window it did not start is untouched


def test_stop_stops_every_peer_even_when_one_is_idle(deployment, tmp_path):
    stub, tracers, _ = deployment
    tracers["prepare"].start(tmp_path)
    tracers["reclaim"].start(tmp_path)
    with pytest.raises(grpc.RpcError) as failed:
        stub.StopProfile(admin_pb2.StopProfileRequest())
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "device" in failed.value.details() and "written: prepare:" in failed.value.details()
    assert "device: no trace window is recording; start one with StartProfile" in failed.value.details()
    assert "start()" not in failed.value.details()
    assert not tracers["prepare"].enabled and not tracers["reclaim"].enabled


def test_empty_trace_dir_is_invalid(deployment):
    stub, tracers, _ = deployment
    with pytest.raises(grpc.RpcError) as failed:
        stub.StartProfile(admin_pb2.StartProfileRequest())
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trace_dir" in failed.value.details()
    assert not any(t.enabled for t in tracers.values())
