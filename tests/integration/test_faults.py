"""Issues 20 and 33 against the real services: a stopped device is noticed and used again, a slow one
is not taken for stopped, a killed one's streams resume once it is back, no abort is lost, a burst
is admitted, edge sampling values stay finite, errors carry google.rpc details."""

from __future__ import annotations

import math
import os
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from stageserve.launcher import ServiceProcess
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc

from .conftest import DEVICE_ARGS, launch

LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SIM_DEVICE = ["--backend", "sim", "--sim-step-ms", "20"]


def prompt(max_tokens: int, **fields) -> prepare_pb2.GenerateRequest:
    return prepare_pb2.GenerateRequest(prompt="Once upon a time", max_tokens=max_tokens, ignore_eos=True, **fields)


def details(error: grpc.RpcError) -> dict[str, object]:
    """The google.rpc details of an error status, by message type name."""
    status = rpc_status.from_call(error)
    assert status is not None and status.code == error.code().value[0] and status.message == error.details()
    found = {}
    for packed in status.details:
        for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            if packed.Is(kind.DESCRIPTOR):
                found[kind.DESCRIPTOR.name] = kind()
                packed.Unpack(found[kind.DESCRIPTOR.name])
    return found


# ---- on the shared pipeline (real model) ------------------------------------------------------------
def test_invalid_argument_carries_field_violation_and_reason(generation):
    with pytest.raises(grpc.RpcError) as error:
        generation.Generate(prompt(4, top_p=2.0))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = details(error.value)
    assert found["ErrorInfo"].reason == "INVALID_FIELD" and found["ErrorInfo"].domain == "stageserve.v1"
    violation, = found["BadRequest"].field_violations
    assert violation.field == "top_p" and violation.description == error.value.details()
    assert "RetryInfo" not in found


def test_an_abort_sent_before_the_request_registers_ends_it_at_once(generation):
    assert not generation.Abort(prepare_pb2.AbortRequest(request_id="early-1")).aborted  # unknown yet: remembered
    chunks = list(generation.GenerateStream(prompt(200, request_id="early-1")))
    assert chunks[-1].finish_reason == ABORT and chunks[-1].usage.completion_tokens == 0
    # the abort is used up: the id runs normally next time
    assert list(generation.GenerateStream(prompt(3, request_id="early-1")))[-1].finish_reason == LENGTH


def test_abort_racing_the_stream_is_never_lost(generation):
    for attempt in range(10):
        request_id = f"race-{attempt}"
        stream = generation.GenerateStream(prompt(200, request_id=request_id))  # sent; not yet registered
        generation.Abort(prepare_pb2.AbortRequest(request_id=request_id))
        chunks = list(stream)
        assert chunks[-1].finish_reason == ABORT and chunks[-1].usage.completion_tokens < 200


EDGE_VALUES = [  # (field, value); None for the field's name: finite logprobs and text expected
    ("temperature", 1.4e-45), ("temperature", 1e-5), ("temperature", 3.4e38), ("temperature", math.inf), ("temperature", math.nan),
    ("top_p", 1.4e-45), ("top_p", 1.0), ("top_p", 0.0), ("top_p", 1.0000001),
    ("top_k", 1), ("top_k", 49152), ("top_k", 2**32 - 1),
    ("min_p", 1.4e-45), ("min_p", 1.0), ("min_p", 1.0000001),
    ("repetition_penalty", 1.4e-45), ("repetition_penalty", 3.4e38), ("repetition_penalty", 0.0), ("repetition_penalty", math.inf),
]
REFUSED = {("temperature", math.inf), ("temperature", math.nan), ("top_p", 0.0), ("top_p", 1.0000001), ("top_k", 2**32 - 1),
           ("min_p", 1.0000001), ("repetition_penalty", 0.0), ("repetition_penalty", math.inf)}


@pytest.mark.parametrize("field, value", EDGE_VALUES, ids=[f"{f}={v:g}" for f, v in EDGE_VALUES])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0], ids=lambda t: f"with-temperature={t:g}")
def test_edge_sampling_values_are_finite_or_refused(generation, field, value, temperature):
    fields = {"temperature": temperature, "seed": 7, "logprobs": 5, field: value}
    try:
        response = generation.Generate(prepare_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=8,
                                                                   ignore_eos=True, **fields))
    except grpc.RpcError as error:
        assert (field, value) in REFUSED, error.details()
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(f"{field}:")
        assert details(error)["BadRequest"].field_violations[0].field == field
        return
    assert (field, value) not in REFUSED
    assert len(response.token_ids) == 8 and "\ufffd" not in response.text and response.text.strip()
    for logprob in response.logprobs:
        assert all(math.isfinite(x) for x in (logprob.logprob, *logprob.top_logprobs))


# ---- a pipeline of its own: admission (--max-waiting 4, 4 sequence slots) and drain ------------------
def test_burst_is_admitted_queue_full_and_draining_carry_retry_info(tmp_path_factory):
    pipe = launch(tmp_path_factory, "admission", device_args=[*SIM_DEVICE, "--max-num-seqs", "4"], prepare_args=["--max-waiting", "4"])
    try:
        with grpc.insecure_channel(pipe.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            # six at once against 4 free slots and max-waiting 4: all admitted or queued
            barrier, results = threading.Barrier(6), []

            def one() -> None:
                barrier.wait()
                try:
                    results.append(stub.Generate(prompt(8)).finish_reason)
                except grpc.RpcError as error:
                    results.append(error.code())

            threads = [threading.Thread(target=one) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert results == [LENGTH] * 6
            # 4 running + 4 waiting: the next is refused with QUEUE_FULL and a retry delay
            running = [stub.GenerateStream(prompt(150)) for _ in range(4)]
            for stream in running:
                next(stream)
            waiting = [stub.GenerateStream(prompt(2)) for _ in range(4)]
            deadline = time.monotonic() + 60
            while stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).waiting_requests < 4:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with pytest.raises(grpc.RpcError) as full:
                stub.Generate(prompt(2))
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            found = details(full.value)
            assert found["ErrorInfo"].reason == "QUEUE_FULL" and found["RetryInfo"].retry_delay.ToMilliseconds() == 1000
            # SIGTERM: drains the streams above; a new request is refused with DRAINING and a retry delay
            pipe.prepare.process.send_signal(signal.SIGTERM)
            refused = None
            while refused is None:
                try:
                    stub.Generate(prompt(1), timeout=5)
                    time.sleep(0.05)
                except grpc.RpcError as error:
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # still full: prepare has not handled SIGTERM yet
                        time.sleep(0.05)
                    else:
                        refused = error
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            found = details(refused)
            assert found["ErrorInfo"].reason == "DRAINING" and found["RetryInfo"].retry_delay.ToMilliseconds() == 500
            assert [list(stream)[-1].finish_reason for stream in running + waiting] == [LENGTH] * 8
    finally:
        pipe.stop()


# ---- a pipeline of its own: the device process stopped and continued ---------------------------------
def watch_readiness(channel: grpc.Channel) -> tuple[queue.Queue, grpc.Future]:
    """prepare's readiness as Health.Watch reports it, each status put on the queue."""
    statuses: queue.Queue = queue.Queue()
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="stageserve.v1.Generation"))

    def read() -> None:
        try:
            for response in call:
                statuses.put(response.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=read, daemon=True).start()
    return statuses, call


def wait_status(statuses: queue.Queue, wanted: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := statuses.get(timeout=max(0.0, deadline - time.monotonic()))) != wanted:
        pass
    assert status == wanted


@pytest.fixture(scope="module")
def stall_pipeline(tmp_path_factory):
    """A sim device whose steps cost 20 ms + 1 ms per token (a 1,024-token prefill step: 1 s), behind
    a prepare with --stall-timeout 1."""
    pipe = launch(tmp_path_factory, "stall", device_args=[*SIM_DEVICE, "--sim-token-us", "1000", "--max-model-len", "2048"],
                  prepare_args=["--stall-timeout", "1"])
    try:
        yield pipe
    finally:
        pipe.stop()


def test_a_device_slowed_by_long_prefills_stays_ready(stall_pipeline):
    """16 prompts of 1,500 tokens (steps of up to a second and more, queued behind each other past the
    stall timeout): every readiness Check every 200 ms answers SERVING and every request ends OK."""
    with grpc.insecure_channel(stall_pipeline.prepare.address) as channel:
        stub, health = prepare_pb2_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
        request = prepare_pb2.GenerateRequest(prompt_token_ids=[100] * 1500, max_tokens=4, ignore_eos=True)
        with ThreadPoolExecutor(16) as pool:
            replies = [pool.submit(stub.Generate, request, timeout=120) for _ in range(16)]
            checks = []
            while not all(reply.done() for reply in replies):
                checks.append(health.Check(health_pb2.HealthCheckRequest(service="stageserve.v1.Generation")).status)
                time.sleep(0.2)
            assert [reply.result().finish_reason for reply in replies] == [LENGTH] * 16
        assert len(checks) > 10 and set(checks) == {SERVING}, checks


def test_a_stopped_device_is_noticed_and_used_again_once_continued(stall_pipeline):
    pipe, device_address = stall_pipeline, stall_pipeline.device.address
    with grpc.insecure_channel(pipe.prepare.address) as channel:
        stub = prepare_pb2_grpc.GenerationStub(channel)
        statuses, watch = watch_readiness(channel)
        wait_status(statuses, SERVING, 10)
        traffic = [stub.GenerateStream(prompt(200)) for _ in range(4)]
        for stream in traffic:
            next(stream)
        os.kill(pipe.device.pid, signal.SIGSTOP)
        try:
            wait_status(statuses, NOT_SERVING, 10)  # --stall-timeout 1 s, watched 4 times a second
            info = stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
            assert [(d.stalled, d.accepting) for d in info.devices] == [(True, False)]
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(prompt(4), timeout=30)
            assert time.monotonic() - started < 1.0  # fails fast, not at the client's deadline
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"device {device_address} is stalled" in refused.value.details()
            assert details(refused.value)["ErrorInfo"].reason == "DEVICE_STALLED"
        finally:
            os.kill(pipe.device.pid, signal.SIGCONT)
        wait_status(statuses, SERVING, 10)
        assert stub.Generate(prompt(4)).finish_reason == LENGTH
        assert [list(stream)[-1].finish_reason for stream in traffic] == [LENGTH] * 4  # they went on
        assert not stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).devices[0].stalled
        watch.cancel()


# ---- a pipeline of its own: its only device killed and started again on its port ----------------------
def test_streams_of_a_killed_device_resume_once_it_is_back(tmp_path_factory):
    """One device, 4 greedy streams; SIGKILL, then a new device process on the same port: the streams
    wait for it (prepare resumes within 30 s) and end with the tokens of the run without the fault."""
    pipe = launch(tmp_path_factory, "device-restart")
    restarted = None
    try:
        with grpc.insecure_channel(pipe.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            requests = [prepare_pb2.GenerateRequest(prompt=f"Tell me about the number {i}.", max_tokens=48, ignore_eos=True,
                                                    temperature=0.0) for i in range(4)]
            expected = [list(stub.Generate(r, timeout=60).token_ids) for r in requests]
            streams = [stub.GenerateStream(r, timeout=120) for r in requests]
            firsts = [next(stream) for stream in streams]
            os.kill(pipe.device.pid, signal.SIGKILL)
            pipe.device.process.wait(10)
            folder = tmp_path_factory.mktemp("device-restarted")
            restarted = ServiceProcess("device", DEVICE_ARGS, folder, pipe.device.port, folder / "device.log").start()
            got = [list(first.token_ids) + [t for chunk in stream for t in chunk.token_ids] for first, stream in zip(firsts, streams)]
            assert got == expected
    finally:
        pipe.stop()
        if restarted is not None:
            restarted.stop()
