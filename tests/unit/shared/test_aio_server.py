"""``AioServiceServer``: the shared server bootstrap on ``grpc.aio``, its loop on a thread of its own.

Health and readiness set from other threads, reflection, the synchronous Admin servicer (run by the
executor), the port file, and the drain-then-stop sequence of ``run_until_stopped``.
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from stageserve.server import AioServiceServer
from stageserve.tracing import Tracer
from stageserve.v1 import admin_pb2, admin_pb2_grpc

NAME = "stageserve.v1.Test"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def loop_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "test-grpc"]


@pytest.fixture
def served(tmp_path):
    port_file = tmp_path / "port"
    server = AioServiceServer(NAME, "127.0.0.1", 0, max_workers=2, port_file=port_file, tracer=Tracer("test"), thread_name="test-grpc",
                              profile_dir=tmp_path / "profiles")
    server.start([NAME])
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel, port_file
    finally:
        channel.close()
        if loop_threads():
            server.stop(0)


def status(channel: grpc.Channel, service: str) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_reflection_admin_and_port_file(served, tmp_path):
    server, channel, port_file = served
    assert int(port_file.read_text()) == server.port and loop_threads() == ["test-grpc"]
    assert (status(channel, ""), status(channel, NAME)) == (SERVING, NOT_SERVING)
    server.set_ready(True)  # from this thread, not the loop's
    assert status(channel, NAME) == SERVING

    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (answer,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=5)
    assert {NAME, "stageserve.v1.Admin", "grpc.health.v1.Health"} <= {s.name for s in answer.list_services_response.service}

    admin = admin_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.RpcError) as idle:  # a synchronous handler's abort, through the executor
        admin.StopProfile(admin_pb2.StopProfileRequest(), timeout=5)
    assert idle.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    admin.StartProfile(admin_pb2.StartProfileRequest(name="window"), timeout=5)
    (part,) = admin.StopProfile(admin_pb2.StopProfileRequest(), timeout=5).services
    assert part.service == "test" and part.trace_file


def test_set_ready_does_not_wait_for_a_busy_loop(served):
    # prepare's connector sets readiness while holding the lock that handlers on the loop take to
    # place a request: waiting for the loop there would deadlock both.
    server, channel, _ = served
    lock, loop_waits = threading.Lock(), threading.Event()

    def handler_taking_the_lock() -> None:
        loop_waits.set()
        with lock:
            pass

    with lock:
        server.loop.call_soon_threadsafe(handler_taking_the_lock)
        assert loop_waits.wait(5)
        setter = threading.Thread(target=server.set_ready, args=(True,), daemon=True)
        setter.start()
        setter.join(5)
        assert not setter.is_alive()
    assert status(channel, NAME) == SERVING  # applied once the loop is free


def test_run_until_stopped_drains_then_stops_the_loop(served):
    server, channel, _ = served
    server.set_ready(True)
    seen_in_drain = []
    runner = threading.Thread(target=server.run_until_stopped, args=(lambda: seen_in_drain.append(status(channel, NAME)),))
    runner.start()  # not the main thread: no signal handlers installed
    server.request_stop()
    runner.join(10)
    assert not runner.is_alive() and seen_in_drain == [NOT_SERVING]  # readiness off before the drain
    assert loop_threads() == []
    with pytest.raises(grpc.RpcError) as stopped:
        status(channel, "")
    assert stopped.value.code() == grpc.StatusCode.UNAVAILABLE


def test_an_address_it_cannot_bind_is_refused_and_leaves_no_loop_thread():
    with pytest.raises(RuntimeError, match="cannot listen"):
        AioServiceServer(NAME, "203.0.113.1", 0, thread_name="test-grpc-2")  # TEST-NET-3: not this host's
    assert not [t for t in threading.enumerate() if t.name == "test-grpc-2"]
