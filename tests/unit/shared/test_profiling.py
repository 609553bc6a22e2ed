"""``stageserve.v1.Admin``: profile windows started and stopped on one service and forwarded to peers.

Three in-process gRPC servers stand for prepare (forwarding) and its two peers, each with its own
``--profile-dir`` (``<tmp>/<service>``).
"""

from __future__ import annotations

import json
import os
from concurrent import futures
from pathlib import Path

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
def deployment(tmp_path):
    """(prepare stub, {service: tracer}, peers) with prepare forwarding to device and reclaim."""
    tracers = {name: Tracer(name) for name in ("prepare", "device", "reclaim")}
    servers = []
    peers = {}
    for name in ("device", "reclaim"):
        server, address = serve(ProfileServicer(tracers[name], tmp_path / name))
        servers.append(server)
        peers[name] = address
    server, address = serve(ProfileServicer(tracers["prepare"], tmp_path / "prepare", peers))
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
    started = stub.StartProfile(admin_pb2.StartProfileRequest(name="run-1"))
    assert [(p.service, p.address) for p in started.services] == [("prepare", ""), ("device", peers["device"]), ("reclaim", peers["reclaim"])]
    assert [p.trace_dir for p in started.services] == [str(tmp_path / name / "run-1") for name in ("prepare", "device", "reclaim")]
    assert all(tracer.enabled for tracer in tracers.values())
    for name, tracer in tracers.items():
        with tracer.span(f"{name}.work", step_id=1):
            pass
    stopped = stub.StopProfile(admin_pb2.StopProfileRequest())
    assert not any(tracer.enabled for tracer in tracers.values())
    for part in stopped.services:
        assert Path(part.trace_file).parent == tmp_path / part.service / "run-1"
        events = json.loads(open(part.trace_file).read())["traceEvents"]
        assert [e["name"] for e in events if e["ph"] == "X"] == [f"{part.service}.work"]


def test_local_only_leaves_the_peers_alone(deployment, tmp_path):
    stub, tracers, _ = deployment
    stub.StartProfile(admin_pb2.StartProfileRequest(local_only=True))
    assert [t.enabled for t in tracers.values()] == [True, False, False]
    reply = stub.StopProfile(admin_pb2.StopProfileRequest(local_only=True))
    assert [p.service for p in reply.services] == ["prepare"]


def test_a_failing_peer_is_named_and_nothing_is_left_recording(deployment, tmp_path):
    stub, tracers, peers = deployment
    tracers["reclaim"].start(tmp_path / "other")  # reclaim refuses: already recording
    with pytest.raises(grpc.RpcError) as failed:
        stub.StartProfile(admin_pb2.StartProfileRequest(name="run"))
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


def tree(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.mark.parametrize("name", ["../escape", "..", "/abs/path", "a/b", "a\\b", ".hidden", "x" * 65, "nul\x00"])
def test_a_name_that_is_not_a_plain_folder_name_is_refused_and_writes_nothing(deployment, tmp_path, name):
    stub, tracers, _ = deployment
    before = tree(tmp_path.parent)
    with pytest.raises(grpc.RpcError) as failed:
        stub.StartProfile(admin_pb2.StartProfileRequest(name=name))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no paths or separators" in failed.value.details()
    assert tree(tmp_path.parent) == before and not any(t.enabled for t in tracers.values())


def test_a_symbolic_link_out_of_the_folder_is_refused_without_saying_what_exists(deployment, tmp_path):
    stub, tracers, _ = deployment
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "prepare").mkdir()
    os.symlink(outside, tmp_path / "prepare" / "link")
    answers = []
    for name in ("link", "fresh-name"):
        try:
            stub.StartProfile(admin_pb2.StartProfileRequest(name=name, local_only=True))
            answers.append("started")
            stub.StopProfile(admin_pb2.StopProfileRequest(local_only=True))
        except grpc.RpcError as error:
            answers.append(error.code())
    assert answers == [grpc.StatusCode.INVALID_ARGUMENT, "started"]
    assert list(outside.iterdir()) == []


def test_a_trace_dir_path_is_refused(deployment, tmp_path):
    stub, tracers, _ = deployment
    with pytest.raises(grpc.RpcError) as failed:
        stub.StartProfile(admin_pb2.StartProfileRequest(trace_dir=str(tmp_path / "anywhere")))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "trace_dir is no longer accepted; give name" in failed.value.details()
    assert not (tmp_path / "anywhere").exists() and not any(t.enabled for t in tracers.values())
