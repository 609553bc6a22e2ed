"""The reclaim service process against a scripted fake device (in this process), watched through Subscribe.

Covers what the unit tests cannot: the device stream's gRPC plumbing (Attach, Complete, SlotRelease),
retry until the device is up, readiness, the completion timeout on the wall clock, a broken device
stream (UNAVAILABLE terminal events, then reconnect), and SIGTERM (drain, exit 0).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.launcher import ServiceProcess
from stageserve.v1 import common_pb2, device_pb2, device_pb2_grpc, reclaim_pb2, reclaim_pb2_grpc

EOS = 2
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
BREAK = object()  # queued into the fake device: end the Complete stream with UNAVAILABLE


class FakeDevice(device_pb2_grpc.DeviceServicer):
    """Attach answers fixed facts; Complete streams whatever the test queues and records SlotReleases."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.releases: list[int] = []
        self.streams = 0

    def Attach(self, request, context):
        return device_pb2.AttachReply(model_name="fake", eos_token_ids=[EOS], vocab_size=49152, max_num_seqs=4, pipeline_depth=2, instance_id=f"fake-{self.streams + 1}")

    def Complete(self, request_iterator, context):
        self.streams += 1
        threading.Thread(target=self._collect_releases, args=(request_iterator,), daemon=True).start()
        while context.is_active():
            try:
                item = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is BREAK:
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake device restarting")
            yield item

    def _collect_releases(self, request_iterator) -> None:
        try:
            for release in request_iterator:
                self.releases.append(release.ticket)
        except grpc.RpcError:
            pass  # the stream ended


def ticket_event(n: int, rows=(), started=()) -> device_pb2.CompletionEvent:
    return device_pb2.CompletionEvent(ticket=device_pb2.CompletionTicket(
        ticket=n, step_id=n, slot=n % 2, started=list(started), seq_index=[r for r in rows], generation=[1 for _ in rows]))


def output_event(n: int, token_ids=()) -> device_pb2.CompletionEvent:
    return device_pb2.CompletionEvent(output=device_pb2.StepOutput(ticket=n, step_id=n, token_ids=list(token_ids)))


def start(seq_index: int, request_id: str, max_tokens: int = 50) -> common_pb2.SequenceStart:
    return common_pb2.SequenceStart(seq_index=seq_index, generation=1, request_id=request_id,
                                    stop=common_pb2.StopParams(max_tokens=max_tokens), prompt_token_ids=[1])


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def readiness(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        request = health_pb2.HealthCheckRequest(service="stageserve.v1.Reclaim")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


class Subscriber:
    """Collects a Subscribe stream on a thread."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.steps: queue.Queue = queue.Queue()
        self.call = reclaim_pb2_grpc.ReclaimStub(self.channel).Subscribe(reclaim_pb2.SubscribeRequest(peer="test"))
        self.ended = threading.Event()
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        try:
            for step in self.call:
                self.steps.put(step)
        except grpc.RpcError:
            pass
        self.ended.set()

    def next(self, timeout_s: float = 20.0) -> reclaim_pb2.StepEvents:
        return self.steps.get(timeout=timeout_s)


def test_reclaim_against_a_fake_device(tmp_path, tokenizer):
    fake = FakeDevice()
    device_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    device_pb2_grpc.add_DeviceServicer_to_server(fake, device_server)
    with socket.socket() as probe:  # a free port nobody listens on yet: the device is "not up"
        probe.bind(("127.0.0.1", 0))
        device_port = probe.getsockname()[1]
    reclaim = ServiceProcess("reclaim", ["--device", f"127.0.0.1:{device_port}", "--completion-timeout", "1",
                                         "--drain-timeout", "5"], tmp_path, log_path=tmp_path / "reclaim.log")
    subscriber = None
    try:
        reclaim.start().wait_port()
        log = tmp_path / "reclaim.log"
        wait_for(lambda: log.read_text().count("not reachable") >= 2, 60)  # the device is not up: retried
        assert readiness(reclaim.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        device_server.add_insecure_port(f"127.0.0.1:{device_port}")
        device_server.start()
        reclaim.wait_ready(60)
        subscriber = Subscriber(reclaim.address)
        n = 0
        while subscriber.steps.empty():  # empty steps until the subscription is surely registered
            n += 1
            fake.events.put(ticket_event(n))
            fake.events.put(output_event(n))
            time.sleep(0.2)
        while subscriber.next().step_id != n:  # skip to the last empty step
            pass

        # A request streams text, in step order, and ends with LENGTH; every slot is released.
        ids = tokenizer.encode("Hi 😀!", add_special_tokens=False)
        first = n + 1
        fake.events.put(ticket_event(first, [0], [start(0, "r1", max_tokens=len(ids))]))
        for i, token_id in enumerate(ids):
            if i + 1 < len(ids):
                fake.events.put(ticket_event(first + i + 1, [0]))
            fake.events.put(output_event(first + i, [token_id]))
        steps = [subscriber.next() for _ in ids]
        assert [s.step_id for s in steps] == list(range(first, first + len(ids)))
        assert "".join(e.text for s in steps for e in s.events) == "Hi 😀!"
        assert steps[-1].events[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert steps[0].device_instance_id == "fake-1"
        wait_for(lambda: set(range(first, first + len(ids))) <= set(fake.releases))

        # A step whose output never comes fails its request after --completion-timeout (1 s);
        # its late output releases the slot.
        late = first + len(ids)
        fake.events.put(ticket_event(late, [1], [start(1, "r2")]))
        failed = subscriber.next()
        assert failed.step_id == late and failed.events[0].request_id == "r2"
        assert failed.events[0].error_code == UNAVAILABLE and "no output" in failed.events[0].error_message
        assert late not in fake.releases
        fake.events.put(output_event(late, [5]))
        wait_for(lambda: late in fake.releases)

        # A broken device stream fails the live request with UNAVAILABLE; reclaim reconnects.
        fake.events.put(ticket_event(late + 1, [2], [start(2, "r3")]))
        fake.events.put(output_event(late + 1, [ids[0]]))
        assert subscriber.next().events[0].text == "Hi"
        fake.events.put(BREAK)
        lost = subscriber.next()
        assert lost.ticket == 0 and [(e.request_id, e.error_code) for e in lost.events] == [("r3", UNAVAILABLE)]
        wait_for(lambda: fake.streams == 2)
        reclaim.wait_ready(30)
        fake.events.put(ticket_event(1, [0], [start(0, "r4", max_tokens=1)]))
        fake.events.put(output_event(1, [ids[0]]))
        after = subscriber.next()
        assert after.device_instance_id == "fake-2" and after.events[0].finish_reason == common_pb2.FINISH_REASON_LENGTH

        # SIGTERM: drain (nothing live), end the subscriber streams, exit 0.
        assert reclaim.stop(timeout_s=20) == 0
        assert subscriber.ended.wait(10)
    finally:
        reclaim.stop(timeout_s=10)
        if subscriber is not None:
            subscriber.channel.close()
        device_server.stop(0)
