"""No single point of failure for the public API: two replicas, each a whole stack (prepare, device,
reclaim) on the embedded model, as deploy/k8s runs them (docs/deploy.md, "Replicas").

A client reaches both through one round-robin channel and retries ``UNAVAILABLE`` with
:func:`stageserve.retrying.stream_generation`. One replica is killed (SIGKILL, all three of its
processes: a pod lost) while greedy streams run on both: every request ends with its full answer,
equal to the same load's answer without the fault.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stageserve.client import open_channel
from stageserve.launcher import Pipeline
from stageserve.retrying import stream_generation
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc

from .conftest import launch_in
from .test_generation_api import chat

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.", "Say hello in Spanish."]
MAX_TOKENS = 24  # ignore_eos: each stream runs this many steps, long enough to be cut mid-way
LENGTH = common_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory):
    """Two stacks, started side by side; every process stopped by pid at the end, even on failure."""
    # One torch thread each: the two devices share the machine's cores.
    folders = [tmp_path_factory.mktemp(f"replica-{name}") for name in "ab"]
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(launch_in, folder, device_args=["--threads", "1"]) for folder in folders]
    started: list[Pipeline] = [future.result() for future in starting if future.exception() is None]
    try:
        for future in starting:
            if future.exception() is not None:
                raise future.exception()
        yield started
    finally:
        for stack in started:
            stack.stop()


class Load:
    """The streams of one round, each through the retrying client; what each delivered and how often it retried."""

    def __init__(self, stub: prepare_pb2_grpc.GenerationStub) -> None:
        self.stub = stub
        self.chunks: list[list[prepare_pb2.GenerateStreamResponse]] = [[] for _ in PROMPTS]
        self.errors: list[BaseException | None] = [None] * len(PROMPTS)
        self.retries: list[int] = [0] * len(PROMPTS)
        self.all_streaming = threading.Barrier(len(PROMPTS) + 1)  # every stream has its first chunk, and the test
        self._threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(PROMPTS))]

    def start(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

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
        first = True
        try:
            for chunk in stream_generation(self.stub, request, timeout_s=120, on_retry=lambda error, delay: self._retried(i)):
                self.chunks[i].append(chunk)
                if first and chunk.token_ids:
                    first = False
                    self.all_streaming.wait(60)
        except BaseException as exc:  # recorded for the assertion; the barrier must not wait for this stream
            self.errors[i] = exc
            self.all_streaming.abort()

    def _retried(self, i: int) -> None:
        self.retries[i] += 1


def wait_until_both_serve(stub: prepare_pb2_grpc.GenerationStub, devices: set[str]) -> None:
    """Until round robin has reached both replicas (each answers GetModelInfo with its own device)."""
    seen: set[str] = set()
    for _ in range(50):
        seen |= {d.address for d in stub.GetModelInfo(prepare_pb2.GetModelInfoRequest(), timeout=10).devices}
        if seen == devices:
            return
    pytest.fail(f"round robin reached the devices {sorted(seen)} only, expected {sorted(devices)}")


def test_a_replica_killed_under_load_fails_no_request(replicas):
    first, second = replicas
    with open_channel(f"ipv4:{first.prepare.address},{second.prepare.address}") as channel:
        stub = prepare_pb2_grpc.GenerationStub(channel)
        wait_until_both_serve(stub, {first.device.address, second.device.address})
        calm = Load(stub).start()
        calm.all_streaming.wait(60)
        calm.join()
        reference = calm.answers()
        assert calm.retries == [0] * len(PROMPTS)

        faulty = Load(stub).start()
        faulty.all_streaming.wait(60)  # every stream has tokens: round robin put two on each replica
        for process in first.processes:  # the whole pod: prepare, reclaim, device
            os.kill(process.pid, signal.SIGKILL)
        faulty.join()
        assert faulty.answers() == reference
        # The killed replica's streams were broken mid-way and retried on the other; the others never were.
        assert sum(1 for count in faulty.retries if count) == 2, faulty.retries
        assert all(process.process.wait(10) == -signal.SIGKILL for process in first.processes)
        # The survivor still answers new requests.
        request = chat(PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        text = "".join(c.text for c in stream_generation(stub, request, timeout_s=60))
        assert text == reference[0][0]
