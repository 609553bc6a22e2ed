"""No single point of failure for the public API: two replicas, each a whole stack (prepare, device,
reclaim) on the embedded model, as deploy/k8s runs them (docs/deploy.md, "Replicas").

A client reaches both through one round-robin channel and retries ``UNAVAILABLE`` with
:func:`stageserve.retrying.stream_generation`. Greedy streams run on both while one replica goes:

- drained, as a rollout or a node drain ends a pod (SIGTERM to its three processes at once), with
  new requests arriving: its streams finish on it, the new ones it refuses are retried on the
  other, and it exits 0; a new replica then takes its place;
- killed (SIGKILL, all three processes: a pod lost): its streams are retried on the other.

Every request ends with its full answer, equal to the same load's answer without the fault.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.client import open_channel
from stageserve.launcher import SERVICE_NAMES, Pipeline
from stageserve.retrying import stream_generation
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc

from .conftest import launch_in
from .test_generation_api import chat

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.", "Say hello in Spanish."]
MAX_TOKENS = 64  # ignore_eos: each stream runs this many steps, long enough to be cut mid-way (on a loaded machine too)
LENGTH = common_pb2.FINISH_REASON_LENGTH


DEVICE_ARGS = ["--threads", "1"]  # one torch thread each: the devices share the machine's cores


class Replicas:
    """The replicas serving now (:attr:`serving`) and every one started, to stop by pid at the end."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._folders = tmp_path_factory
        self.started: list[Pipeline] = []
        self.serving: list[Pipeline] = []

    def start(self, names: str) -> None:
        """Start one replica per letter of ``names``, side by side; add them to :attr:`serving`."""
        folders = [self._folders.mktemp(f"replica-{name}") for name in names]  # the factory is not thread-safe
        with ThreadPoolExecutor(len(folders)) as pool:
            starting = [pool.submit(launch_in, folder, device_args=DEVICE_ARGS) for folder in folders]
        fresh = [future.result() for future in starting if future.exception() is None]
        self.started += fresh
        for future in starting:
            if future.exception() is not None:
                raise future.exception()
        # A replica's first request is slower (first chat template, first prefill): served here, so
        # that under load every replica streams at the same pace.
        for stack in fresh:
            with open_channel(stack.prepare.address) as channel:
                warm_up = chat(PROMPTS[0], temperature=0.0, max_tokens=2)
                assert len(list(prepare_pb2_grpc.GenerationStub(channel).GenerateStream(warm_up, timeout=60))) >= 1
        self.serving += fresh

    @contextmanager
    def client(self):
        """A Generation stub over every serving replica (round robin), once each one has answered."""
        addresses = ",".join(stack.prepare.address for stack in self.serving)
        with open_channel(f"ipv4:{addresses}") as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            wait_until_all_serve(stub, {stack.device.address for stack in self.serving})
            yield stub


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory):
    """Two replicas; every process started stopped by pid at the end, even on failure."""
    started = Replicas(tmp_path_factory)
    try:
        started.start("ab")
        yield started
    finally:
        for stack in started.started:
            stack.stop()


@pytest.fixture(scope="module")
def reference(replicas: Replicas) -> list[tuple[str, list[int]]]:
    """Each stream's (text, token ids) from the load without a fault, over both replicas."""
    with replicas.client() as stub:
        calm = Load(stub).start()
        calm.wait_streaming()
        calm.join()
        assert calm.retries == [0] * len(PROMPTS)
        return calm.answers()


class Load:
    """The streams of one round, each through the retrying client; what each delivered and how often it retried."""

    def __init__(self, stub: prepare_pb2_grpc.GenerationStub) -> None:
        self.stub = stub
        self.chunks: list[list[prepare_pb2.GenerateStreamResponse]] = [[] for _ in PROMPTS]
        self.errors: list[BaseException | None] = [None] * len(PROMPTS)
        self.retries: list[int] = [0] * len(PROMPTS)
        self.delays_s: list[float] = []  # of every retry
        self._streaming = [threading.Event() for _ in PROMPTS]  # set at a stream's first tokens, or its end
        self._threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(PROMPTS))]

    def start(self) -> "Load":
        """Start every stream (returns at once)."""
        for thread in self._threads:
            thread.start()
        return self

    def wait_streaming(self, timeout_s: float = 60.0) -> None:
        """Until every stream has received tokens."""
        for i, event in enumerate(self._streaming):
            assert event.wait(timeout_s) and self.errors[i] is None, f"stream {i} got no tokens: {self.errors[i]}"

    def join(self) -> None:
        for thread in self._threads:
            thread.join(180)
        assert not any(thread.is_alive() for thread in self._threads), "a stream did not end within 180 s"

    def answers(self) -> list[tuple[str, list[int]]]:
        assert self.errors == [None] * len(PROMPTS), self.errors
        for chunks in self.chunks:
            assert chunks[-1].finish_reason == LENGTH and chunks[-1].usage.completion_tokens == MAX_TOKENS
        return [("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids]) for chunks in self.chunks]

    def _one(self, i: int) -> None:
        request = chat(PROMPTS[i], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        try:
            for chunk in stream_generation(self.stub, request, timeout_s=120, on_retry=lambda error, delay_s: self._retried(i, delay_s)):
                self.chunks[i].append(chunk)
                if chunk.token_ids:
                    self._streaming[i].set()
        except BaseException as exc:  # recorded for the assertion
            self.errors[i] = exc
        finally:
            self._streaming[i].set()

    def _retried(self, i: int, delay_s: float) -> None:
        self.retries[i] += 1
        self.delays_s.append(delay_s)


def wait_until_all_serve(stub: prepare_pb2_grpc.GenerationStub, devices: set[str]) -> None:
    """Until round robin has reached every replica (each answers GetModelInfo with its own device)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a new channel's picker holds only the replicas connected so far
        seen |= {d.address for d in stub.GetModelInfo(prepare_pb2.GetModelInfoRequest(), timeout=10).devices}
        if seen == devices:
            return
        time.sleep(0.05)
    pytest.fail(f"round robin reached the devices {sorted(seen)} only, expected {sorted(devices)}")


def wait_draining(stack: Pipeline, timeout_s: float = 30.0) -> None:
    """Until the replica's prepare reports NOT_SERVING (it has handled SIGTERM)."""
    request = health_pb2.HealthCheckRequest(service=SERVICE_NAMES["prepare"])
    deadline = time.monotonic() + timeout_s
    with open_channel(stack.prepare.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(request, timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, f"prepare still SERVING {timeout_s:.0f} s after SIGTERM"
            time.sleep(0.02)


def test_a_replica_drained_under_load_fails_no_request(replicas, reference):
    """A rollout's step: SIGTERM ends one replica (as the kubelet ends a pod: its three containers at
    once) while its streams run and new requests come; then a new replica takes its place."""
    try:
        with replicas.client() as stub:
            running = Load(stub).start()
            running.wait_streaming()  # every stream has tokens: round robin put two on each replica
            leaving = replicas.serving.pop(0)
            for process in leaving.processes:
                os.kill(process.pid, signal.SIGTERM)
            wait_draining(leaving)  # the signal handled: from now on it refuses what it is sent
            arriving = Load(stub).start()  # two refused by the draining replica, retried on the other
            running.join()
            arriving.join()
            assert running.answers() == reference and running.retries == [0] * len(PROMPTS)  # finished where they ran
            assert arriving.answers() == reference
            assert 0.5 in arriving.delays_s, arriving.delays_s  # DRAINING's RetryInfo delay, honoured
            assert [process.process.wait(60) for process in leaving.processes] == [0, 0, 0]  # each drained, exit 0
    finally:
        replicas.start("c")  # the next test has two replicas whatever happened here


def test_a_replica_killed_under_load_fails_no_request(replicas, reference):
    with replicas.client() as stub:
        load = Load(stub).start()
        load.wait_streaming()  # every stream has tokens: round robin put two on each replica
        killed = replicas.serving.pop(0)
        for process in killed.processes:  # the whole pod: prepare, reclaim, device
            os.kill(process.pid, signal.SIGKILL)
        load.join()
        assert load.answers() == reference
        # The killed replica's streams were broken mid-way and retried on the other; the others never were.
        assert sum(1 for count in load.retries if count) == 2, load.retries
        assert all(process.process.wait(10) == -signal.SIGKILL for process in killed.processes)
        # The survivor still answers new requests.
        request = chat(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert "".join(c.text for c in stream_generation(stub, request, timeout_s=60)) == reference[0][0]
