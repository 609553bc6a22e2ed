"""The load generator: drives ``GenerateStream`` calls of a `Workload` and records what the client sees.

Two ways to load (`Load`): a fixed number of concurrent streams (each starts its next request when
the previous one ends) or a Poisson arrival rate (exponential gaps from a seeded generator,
optionally capped in concurrency). A run stops sending after ``requests`` requests or
``duration_s`` seconds, whichever comes first, and waits for those in flight.

The driver is one asyncio loop; where the calls go is a `Transport`: `GrpcTransport` (a real
client of prepare's public API) or the in-process pipeline of `stageserve.bench.inprocess`, so the
same schedule and the same timing code measure both sides of a comparison.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from stageserve.bench.metrics import RequestRecord
from stageserve.bench.workload import Workload
from stageserve.v1 import prepare_pb2

class StreamFailed(Exception):
    """A request ended with a gRPC status other than OK (``status`` is the code's name)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Transport(Protocol):
    """Where requests go: yields ``(arrival perf_counter seconds, chunk)``; raises `StreamFailed`."""

    def stream(self, request: prepare_pb2.GenerateRequest) -> AsyncIterator[tuple[float, prepare_pb2.GenerateStreamResponse]]:
        ...


class GrpcTransport:
    """``GenerateStream`` over one gRPC channel to prepare at ``target`` (create inside the event loop);
    over TLS trusting ``tls_ca`` when given, with ``api_key`` as a bearer token when given."""

    def __init__(self, target: str, tls_ca: Path | None = None, api_key: str = "") -> None:
        import grpc

        from stageserve.client import key_metadata
        from stageserve.v1 import prepare_pb2_grpc

        self._grpc = grpc
        self._channel = (grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(tls_ca.read_bytes())) if tls_ca
                         else grpc.aio.insecure_channel(target))
        self._stub = prepare_pb2_grpc.GenerationStub(self._channel)
        self._metadata = key_metadata(api_key)

    async def stream(self, request: prepare_pb2.GenerateRequest) -> AsyncIterator[tuple[float, prepare_pb2.GenerateStreamResponse]]:
        try:
            async for chunk in self._stub.GenerateStream(request, metadata=self._metadata):
                yield time.perf_counter(), chunk
        except self._grpc.aio.AioRpcError as exc:
            raise StreamFailed(exc.code().name, exc.details() or "") from None

    async def close(self) -> None:
        await self._channel.close()


def grpc_tokenizer(target: str, tls_ca: Path | None = None, api_key: str = "") -> Callable[[prepare_pb2.GenerateRequest], list[int]]:
    """Token ids of a request's input as prepare computes them (its ``Tokenize`` RPC)."""
    from stageserve.client import key_metadata, open_channel
    from stageserve.v1 import prepare_pb2_grpc

    def tokenize(request: prepare_pb2.GenerateRequest) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        with open_channel(target, tls_ca) as channel:
            reply = prepare_pb2_grpc.GenerationStub(channel).Tokenize(
                prepare_pb2.TokenizeRequest(prompt=request.prompt, messages=request.messages), timeout=30, metadata=key_metadata(api_key))
        return list(reply.token_ids)

    return tokenize


@dataclass(frozen=True)
class Load:
    """How to load the server: set exactly one of ``streams`` and ``rate``, at least one of ``requests`` and ``duration_s``.

    Attributes:
        streams: concurrent streams.
        rate: Poisson arrivals, requests per second.
        max_concurrency: with ``rate``: requests in flight at most (a request waits for a free place).
        requests: requests to send at most.
        duration_s: seconds after which no new request is sent.
        seed: seeds the Poisson gaps.
    """

    streams: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None
    requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def check(self) -> None:
        """Raises ValueError naming the flag when the combination is not runnable."""
        if (self.streams is None) == (self.rate is None):
            raise ValueError("give exactly one of --streams and --rate")
        if self.requests is None and self.duration_s is None:
            raise ValueError("give --requests, --duration or both")
        for flag, value in (("--streams", self.streams), ("--rate", self.rate), ("--requests", self.requests),
                            ("--duration", self.duration_s), ("--max-concurrency", self.max_concurrency)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be positive, got {value}")


class Progress:
    """A one-line progress bar on ``out`` (stderr), redrawn at most every 0.2 s; silent when disabled."""

    def __init__(self, load: Load, out: TextIO | None = sys.stderr, width: int = 30) -> None:
        self._load, self._out, self._width = load, out, width
        self._start = time.perf_counter()
        self._done = self._failed = self._tokens = 0
        self._drawn = 0.0

    def request_ended(self, record: RequestRecord) -> None:
        self._done += 1
        self._failed += not record.ok
        self._tokens += record.completion_tokens
        self.draw()

    def draw(self, final: bool = False) -> None:
        now = time.perf_counter()
        if self._out is None or (not final and now - self._drawn < 0.2):
            return
        self._drawn = now
        elapsed = now - self._start
        fractions = []
        if self._load.requests:
            fractions.append(self._done / self._load.requests)
        if self._load.duration_s:
            fractions.append(elapsed / self._load.duration_s)
        fraction = min(1.0, max(fractions))
        bar = "#" * round(fraction * self._width)
        self._out.write(f"\r[{bar:<{self._width}}] {self._done} done, {self._failed} failed, {self._tokens} tokens, {elapsed:.1f} s ")
        if final:
            self._out.write("\n")
        self._out.flush()


async def run_load(make_transport: Callable[[], Transport], workload: Workload, load: Load, progress: bool = True) -> list[RequestRecord]:
    """`drive` with a transport made inside the running event loop (gRPC's aio channels need one), closed afterwards."""
    transport = make_transport()
    try:
        return await drive(transport, workload, load, Progress(load) if progress else None)
    finally:
        await close_transport(transport)


async def close_transport(transport: Transport) -> None:
    """Close ``transport`` if it holds something to close (a channel; llama-server's has one connection per request)."""
    close = getattr(transport, "close", None)
    if close is not None:
        await close()


async def drive(transport: Transport, workload: Workload, load: Load, progress: Progress | None = None) -> list[RequestRecord]:
    """Run ``load`` of ``workload`` against ``transport``; return one record per request sent, in index order.

    Raises:
        ValueError: ``load`` is not runnable (see `Load.check`).
    """
    load.check()
    start = time.perf_counter()
    records: dict[int, RequestRecord] = {}

    def may_send(index: int) -> bool:
        return (load.requests is None or index < load.requests) and (load.duration_s is None or time.perf_counter() - start < load.duration_s)

    async def one(index: int) -> None:
        record = records[index] = RequestRecord(sent_s=time.perf_counter())
        try:
            async for arrival, chunk in transport.stream(workload.request(index)):
                if chunk.token_ids:
                    record.chunks.append((arrival, len(chunk.token_ids)))
                if chunk.finish_reason:
                    record.prompt_tokens, record.completion_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
        except StreamFailed as exc:
            record.status = exc.status
        record.ended_s = time.perf_counter()
        if progress is not None:
            progress.request_ended(record)

    if load.streams is not None:
        counter = iter(range(sys.maxsize))

        async def stream_worker() -> None:
            while may_send(index := next(counter)):
                await one(index)

        await asyncio.gather(*(stream_worker() for _ in range(load.streams)))
    else:
        gaps = random.Random(load.seed)
        slots = asyncio.Semaphore(load.max_concurrency or sys.maxsize)

        async def limited(index: int) -> None:
            async with slots:
                await one(index)

        tasks, index, due = [], 0, start
        while may_send(index):
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if not may_send(index):
                break
            tasks.append(asyncio.create_task(limited(index)))
            index += 1
            due += gaps.expovariate(load.rate)
        await asyncio.gather(*tasks)
    if progress is not None:
        progress.draw(final=True)
    return [records[i] for i in sorted(records)]
