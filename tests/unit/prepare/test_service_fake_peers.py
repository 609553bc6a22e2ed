"""prepare's public API, step loop and links in-process, against fake device and reclaim peers
(``fake_peers.py``) and the embedded model's real tokenizer."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry

from stageserve.device_endpoints import parse_device_endpoints
from stageserve.prepare.service import GenerationServicer
from stageserve.prepare.connector import PipelineConnector
from stageserve.prepare.frontend import GenerationFrontend
from stageserve.prepare.engine import Engine
from stageserve.prepare.service import SERVICE_NAME
from stageserve.prepare.metrics import PrepareMetrics
from stageserve.prepare.request_handle import LoopWaker
from stageserve.prepare.router import DeviceRouter
from stageserve.server import AioServiceServer
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc

from .fake_peers import FakePeers

LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def tokenizer():
    from stageserve.model_files import embedded_model_path
    from stageserve.tokenizer import load_tokenizer

    return load_tokenizer(embedded_model_path())


class Prepare:
    """The prepare service wired as ``main.run`` wires it, on an ephemeral port, without signals."""

    def __init__(self, peers: FakePeers, tokenizer, max_waiting: int = 8, device: str = "", resolver=socket.getaddrinfo) -> None:
        self.server = AioServiceServer(SERVICE_NAME, "127.0.0.1", 0)
        metrics = PrepareMetrics(CollectorRegistry())
        self.connector = PipelineConnector(
            parse_device_endpoints(device or f"127.0.0.1:{peers.device_port}"), f"127.0.0.1:{peers.reclaim_port}",
            new_engine=lambda: Engine(max_prefill_chunk=16, max_waiting=max_waiting, metrics=metrics),
            on_ready=lambda up: self.server.set_ready(up and not self.router.draining), step_timeout_s=10, refresh_s=0.05,
            resolver=resolver,
        )
        self.router = DeviceRouter(self.connector.sessions, metrics, lambda: self.server.stop_requested)
        self.server.add_servicer(prepare_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(GenerationFrontend(self.router, tokenizer, LoopWaker(self.server.loop))))
        self.server.start([SERVICE_NAME])
        self.connector.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = prepare_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.wait_health(SERVING)

    def wait_health(self, status: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status != status:
            assert time.monotonic() < deadline, f"readiness never became {status}"
            time.sleep(0.02)

    def kv_free_and_total(self) -> tuple[int, int]:
        info = self.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
        return info.kv_blocks_free, info.kv_blocks_total

    def wait_kv_all_free(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (figures := self.kv_free_and_total())[0] != figures[1]:
            assert time.monotonic() < deadline, f"KV blocks did not return to the pool: {figures}"
            time.sleep(0.02)

    def stop(self) -> None:
        self.channel.close()
        self.connector.stop()
        self.server.stop(0)


@pytest.fixture(scope="module")
def peers():
    started = FakePeers(step_delay_s=0.01)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def prepare(peers, tokenizer):
    service = Prepare(peers, tokenizer)
    try:
        yield service
    finally:
        service.stop()


def chat(text: str, **fields) -> prepare_pb2.GenerateRequest:
    return prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content=text)], **fields)


def test_stream_has_chunks_final_usage_and_request_id_header(prepare, tokenizer):
    call = prepare.stub.GenerateStream(chat("Hello", max_tokens=5, request_id="s-1"))
    chunks = list(call)
    assert dict(call.initial_metadata())["x-request-id"] == "s-1"
    assert "".join(c.text for c in chunks) == "t1 t2 t3 t4 t5 "
    assert [t for c in chunks for t in c.token_ids] == [1001, 1002, 1003, 1004, 1005]
    assert all(c.request_id == "s-1" for c in chunks)
    assert [c.finish_reason for c in chunks] == [0, 0, 0, 0, LENGTH]
    prompt_tokens = len(tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True, return_dict=False))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 5)
    prepare.wait_kv_all_free()


def test_unary_aggregates_and_takes_the_id_from_metadata(prepare):
    response, call = prepare.stub.Generate.with_call(prepare_pb2.GenerateRequest(prompt="Hi", max_tokens=3), metadata=[("x-request-id", "meta-7")])
    assert response.request_id == "meta-7" and dict(call.initial_metadata())["x-request-id"] == "meta-7"
    assert response.text == "t1 t2 t3 " and list(response.token_ids) == [1001, 1002, 1003]
    assert response.finish_reason == LENGTH and response.usage.completion_tokens == 3
    generated = prepare.stub.Generate(prepare_pb2.GenerateRequest(prompt="Hi", max_tokens=1))
    assert len(generated.request_id) == 32  # a generated uuid4 hex


def test_started_sequence_travels_whole_once_with_its_parameters(prepare, peers):
    prepare.stub.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, seed=9, request_id="whole"))
    starts = [s for plan in peers.device.plans for s in plan.started if s.request_id == "whole"]
    assert len(starts) == 1
    start = starts[0]
    assert list(start.prompt_token_ids) == [5, 6, 7] and start.sampling.seed == 9 and start.sampling.temperature == 0.0
    assert start.stop.max_tokens == 2 and start.stop.prompt_tokens == 3
    rows = [
        (plan.start_pos[r], plan.num_tokens[r], plan.sample[r], plan.token_ids[sum(plan.num_tokens[:r])])
        for plan in peers.device.plans
        for r in range(len(plan.seq_index))
        if (plan.seq_index[r], plan.generation[r]) == (start.seq_index, start.generation)
    ]
    assert rows == [(0, 3, True, 5), (3, 1, True, -1)]  # the prompt, then one decode row on a placeholder


def test_abort_mid_stream_ends_with_abort_and_is_idempotent(prepare):
    stream = prepare.stub.GenerateStream(chat("Count", max_tokens=200, request_id="abort-me"))
    first = next(stream)
    assert first.request_id == "abort-me"
    assert prepare.stub.Abort(prepare_pb2.AbortRequest(request_id="abort-me")).aborted
    rest = list(stream)
    assert rest[-1].finish_reason == ABORT
    assert not prepare.stub.Abort(prepare_pb2.AbortRequest(request_id="abort-me")).aborted
    assert not prepare.stub.Abort(prepare_pb2.AbortRequest(request_id="never-was")).aborted
    prepare.wait_kv_all_free()


def test_client_cancel_and_deadline_free_kv(prepare):
    stream = prepare.stub.GenerateStream(chat("Count", max_tokens=200))
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as cancelled:
        list(stream)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as late:
        list(prepare.stub.GenerateStream(chat("Count", max_tokens=200), timeout=0.3))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    prepare.wait_kv_all_free()
    info = prepare.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    assert (info.running_requests, info.waiting_requests) == (0, 0)


def test_duplicate_active_id_is_already_exists(prepare):
    stream = prepare.stub.GenerateStream(chat("Count", max_tokens=200, request_id="dup"))
    next(stream)
    with pytest.raises(grpc.RpcError) as duplicate:
        prepare.stub.Generate(chat("Again", max_tokens=2, request_id="dup"))
    assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS and "dup" in duplicate.value.details()
    prepare.stub.Abort(prepare_pb2.AbortRequest(request_id="dup"))
    assert list(stream)[-1].finish_reason == ABORT
    assert prepare.stub.Generate(chat("Again", max_tokens=2, request_id="dup")).finish_reason == LENGTH  # free again


def test_reclaim_error_event_becomes_the_status(prepare):
    with pytest.raises(grpc.RpcError) as failed:
        list(prepare.stub.GenerateStream(chat("x", max_tokens=4, request_id="fail-1")))
    assert failed.value.code() == grpc.StatusCode.INTERNAL and failed.value.details() == "boom"
    prepare.wait_kv_all_free()


def test_refused_step_fails_its_request_with_internal(prepare, peers):
    peers.device.refuse_steps_with_request = "refuse-me"
    try:
        with pytest.raises(grpc.RpcError) as refused:
            prepare.stub.Generate(chat("x", max_tokens=4, request_id="refuse-me"))
    finally:
        peers.device.refuse_steps_with_request = ""
    assert refused.value.code() == grpc.StatusCode.INTERNAL and "refused on purpose" in refused.value.details()
    assert prepare.stub.Generate(chat("x", max_tokens=2)).finish_reason == LENGTH  # the pipeline keeps serving
    prepare.wait_kv_all_free()


def test_invalid_argument_and_tokenize(prepare, tokenizer):
    with pytest.raises(grpc.RpcError) as bad:
        prepare.stub.Generate(prepare_pb2.GenerateRequest(prompt="hi", top_p=2.0))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in bad.value.details()
    with pytest.raises(grpc.RpcError) as long:
        prepare.stub.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=[1] * 250, max_tokens=7))
    assert long.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "256" in long.value.details()
    tokens = prepare.stub.Tokenize(prepare_pb2.TokenizeRequest(prompt="Hello world"))
    assert list(tokens.token_ids) == tokenizer.encode("Hello world") and tokens.count == len(tokens.token_ids)
    assert list(tokens.tokens) == tokenizer.convert_ids_to_tokens(list(tokens.token_ids))
    with pytest.raises(grpc.RpcError) as empty:
        prepare.stub.Tokenize(prepare_pb2.TokenizeRequest())
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_info_reports_the_device_facts(prepare):
    info = prepare.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    assert (info.model_name, info.vocab_size, info.max_model_len, list(info.eos_token_ids)) == ("fake", 49152, 256, [2])
    assert (info.kv_block_size, info.kv_blocks_total, info.max_num_seqs, info.pipeline_depth, info.backend) == (16, 64, 4, 2, "sim")


def test_many_concurrent_streams_all_complete(prepare):
    """More requests than seq indices (4): the rest wait, all finish with their own tokens."""
    results: dict[int, list] = {}

    def one(i: int) -> None:
        results[i] = list(prepare.stub.GenerateStream(chat(f"q{i}", max_tokens=3 + i, request_id=f"many-{i}")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i, chunks in results.items():
        assert [t for c in chunks for t in c.token_ids] == [1001 + n for n in range(3 + i)]
        assert chunks[-1].finish_reason == LENGTH and {c.request_id for c in chunks} == {f"many-{i}"}
    assert len(results) == 8
    prepare.wait_kv_all_free()


def test_full_waiting_queue_is_resource_exhausted(tokenizer):
    peers = FakePeers(step_delay_s=0.02, max_num_seqs=1)
    service = Prepare(peers, tokenizer, max_waiting=1)
    try:
        running = service.stub.GenerateStream(chat("a", max_tokens=100))
        next(running)
        waiting = service.stub.GenerateStream(chat("b", max_tokens=2))  # waits for the only index
        deadline = time.monotonic() + 60
        while service.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).waiting_requests != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as full:
            service.stub.Generate(chat("c", max_tokens=2))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting queue is full" in full.value.details()
        running.cancel()
        assert list(waiting)[-1].finish_reason == LENGTH
        service.wait_kv_all_free()
    finally:
        service.stop()
        peers.stop()


def test_device_loss_fails_in_flight_with_unavailable_then_reconnects(tokenizer):
    peers = FakePeers(step_delay_s=0.02)
    service = Prepare(peers, tokenizer)
    try:
        stream = service.stub.GenerateStream(chat("a", max_tokens=200))
        next(stream)
        first_instance = peers.device.attach.instance_id
        peers.stop_device()
        with pytest.raises(grpc.RpcError) as lost:
            list(stream)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        service.wait_health(NOT_SERVING)
        with pytest.raises(grpc.RpcError) as down:
            service.stub.Generate(chat("b", max_tokens=2))
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        # With its only device down, GetModelInfo still answers: the device, not attached.
        info = service.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
        assert [(d.address, d.attached, d.accepting, d.instance_id) for d in info.devices] == [
            (f"127.0.0.1:{peers.device_port}", False, False, "")]
        assert (info.model_name, info.kv_blocks_total, info.running_requests) == ("", 0, 0)
        peers.restart_device()
        service.wait_health(SERVING)
        assert peers.device.attach.instance_id != first_instance
        assert service.stub.Generate(chat("c", max_tokens=3)).text == "t1 t2 t3 "
        service.wait_kv_all_free()
    finally:
        service.stop()
        peers.stop()


def test_drain_lets_streams_finish_and_refuses_new_requests(tokenizer):
    peers = FakePeers(step_delay_s=0.01)
    service = Prepare(peers, tokenizer)
    try:
        stream = service.stub.GenerateStream(chat("a", max_tokens=40))
        first = next(stream)
        drainer = threading.Thread(target=service.router.drain, args=(30.0,))
        drainer.start()
        time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as refused:
            service.stub.Generate(chat("b", max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        chunks = [first, *stream]
        assert chunks[-1].finish_reason == LENGTH and sum(len(c.token_ids) for c in chunks) == 40
        drainer.join(5)
        assert not drainer.is_alive()
    finally:
        service.stop()
        peers.stop()


def test_a_stop_request_refuses_new_requests_before_the_drain_begins(tokenizer):
    """SIGTERM's flag is read by every admission: nothing is accepted in the window before the
    signal's waiter calls the drain (here: never), and what runs goes on."""
    peers = FakePeers(step_delay_s=0.01)
    service = Prepare(peers, tokenizer)
    try:
        stream = service.stub.GenerateStream(chat("a", max_tokens=20))
        first = next(stream)
        service.server.request_stop()  # what the signal handler does; no drain() is called
        with pytest.raises(grpc.RpcError) as refused:
            service.stub.Generate(chat("b", max_tokens=2))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.details()
        status = rpc_status.from_call(refused.value)
        retry = [d for d in status.details if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
        assert len(retry) == 1
        chunks = [first, *stream]
        assert chunks[-1].finish_reason == LENGTH and sum(len(c.token_ids) for c in chunks) == 20
    finally:
        service.stop()
        peers.stop()


class FakeDns:
    """A fake resolver (``socket.getaddrinfo``'s signature, no DNS): answers each name from
    :attr:`answers` (name -> IPv4 addresses); a name without an answer is ``EAI_NONAME``."""

    def __init__(self, **answers: list[str]) -> None:
        self.answers = answers

    def __call__(self, host, port, type=0):
        if not self.answers.get(host):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in self.answers[host]]


def started_here(device, request_ids) -> set[str]:
    """Which of ``request_ids`` the fake ``device`` received a SequenceStart for."""
    return {start.request_id for plan in device.plans for start in plan.started} & set(request_ids)


def test_devices_follow_the_dns_answer_and_a_lost_one_fails_only_its_requests(tokenizer):
    """Two fake devices behind one dns:/// name (127.0.0.1 and 127.0.0.2, same port): requests
    spread over both; an address that leaves the answer gets no new request but finishes its own;
    a device that goes away fails only its requests with UNAVAILABLE."""
    peers = FakePeers(step_delay_s=0.01)
    second, second_server = peers.add_device("127.0.0.2")
    dns = FakeDns(**{"devices.test": ["127.0.0.1"]})
    service = Prepare(peers, tokenizer, device=f"dns:///devices.test:{peers.device_port}", resolver=dns)
    first_address, second_address = f"127.0.0.1:{peers.device_port}", f"127.0.0.2:{peers.device_port}"

    def accepting() -> set[str]:
        return {d.address for d in service.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).devices if d.accepting}

    def wait_accepting(addresses: set[str]) -> None:
        deadline = time.monotonic() + 60
        while accepting() != addresses:
            assert time.monotonic() < deadline, f"accepting {accepting()}, expected {addresses}"
            time.sleep(0.02)

    try:
        assert accepting() == {first_address}
        dns.answers["devices.test"] = ["127.0.0.1", "127.0.0.2"]  # a pod became ready
        wait_accepting({first_address, second_address})
        ids = [f"spread-{i}" for i in range(8)]
        streams = [service.stub.GenerateStream(chat("x", max_tokens=3, request_id=rid)) for rid in ids]
        assert all([c.finish_reason for c in stream][-1] == LENGTH for stream in streams)
        on_first, on_second = started_here(peers.device, ids), started_here(second, ids)
        assert on_first | on_second == set(ids) and not on_first & on_second and len(on_first) == len(on_second) == 4
        info = service.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
        assert info.kv_blocks_total == 2 * 64 == sum(d.kv_blocks_total for d in info.devices)

        # One long request on each device, then the second address leaves the DNS answer.
        long_ids = ["long-a", "long-b"]
        long_streams = [service.stub.GenerateStream(chat("x", max_tokens=200, request_id=rid)) for rid in long_ids]
        for stream in long_streams:
            next(stream)
        (on_second_id,) = started_here(second, long_ids)
        (on_first_id,) = started_here(peers.device, long_ids)
        dns.answers["devices.test"] = ["127.0.0.1"]
        wait_accepting({first_address})
        assert service.stub.Generate(chat("x", max_tokens=2, request_id="after-leave")).finish_reason == LENGTH
        assert started_here(peers.device, ["after-leave"]) == {"after-leave"}
        second_stream, first_stream = (long_streams[long_ids.index(rid)] for rid in (on_second_id, on_first_id))

        peers.stop_device()  # the first device goes away mid-request: only its request fails
        with pytest.raises(grpc.RpcError) as lost:
            list(first_stream)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert [c.finish_reason for c in second_stream][-1] == LENGTH  # unlisted, it still finishes where it started
        service.wait_health(NOT_SERVING)  # the second left the answer, the first is gone: no device
        dns.answers["devices.test"] = ["127.0.0.1", "127.0.0.2"]  # the second is listed again
        service.wait_health(SERVING)
        assert service.stub.Generate(chat("x", max_tokens=3)).text == "t1 t2 t3 "
    finally:
        service.stop()
        second_server.stop(0).wait()
        peers.stop()


def test_device_restart_empties_its_prefix_cache(tokenizer):
    peers = FakePeers(step_delay_s=0.01)
    service = Prepare(peers, tokenizer)
    try:
        ids = list(range(300, 350))  # 3 full blocks of 16 and 2 tokens

        def cached_tokens() -> int:
            return service.stub.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=2)).usage.cached_tokens

        assert [cached_tokens(), cached_tokens()] == [0, 48]
        peers.stop_device()
        service.wait_health(NOT_SERVING)
        peers.restart_device()
        service.wait_health(SERVING)
        assert [d.kv_blocks_cached for d in service.stub.GetModelInfo(prepare_pb2.GetModelInfoRequest()).devices] == [0]
        assert [cached_tokens(), cached_tokens()] == [0, 48]
        service.wait_kv_all_free()
    finally:
        service.stop()
        peers.stop()
