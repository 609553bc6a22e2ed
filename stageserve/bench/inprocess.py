"""The in-process baseline: prepare's engine, the device's core and reclaim's completion handler in
ONE process, wired with direct calls and queues instead of gRPC. Used only by the benchmarks, to
measure what the split into three services costs.

Everything that does the work is the real code: requests are validated and tokenized
(`validate_generate_request`), scheduled by the `Engine` and its `Scheduler` (plans are the same
``StepPlan`` messages, built by `build_step_plan`), submitted by the device's own `PlanSubmitter`
(decode, wait for a slot, admit, submit) to the `StepExecutor` of a device core built by
`stageserve.device.assembly.build_core` (same model, KV pool, backend, warm-up); the executor's tickets
and outputs go through the device's `CompletionOutbox` and reclaim's own stream loop
(`receive`, `consume_stream`) to its `CompletionHandler` (detokenization, stops), whose
``StepEvents`` go straight to `Engine.on_step_events` and whose slot releases straight to
`StepExecutor.release`; chunks are made by prepare's `stream_chunk`. Left out: serialization, the
loopback network, gRPC's threads and the three processes' separate interpreters (the baseline
shares one GIL).

Threads: the engine's step loop; ``inprocess-device`` (the device's Execute handler);
``inprocess-receive`` and ``inprocess-reclaim`` (reclaim's receive thread and stream loop); the
executor's completion thread; one thread per open request stream. On the cpu backend the steps
run on the thread that calls `InProcessPipeline.serve_while` (the main thread), as the device
service runs them on its main thread; so the load goes inside ``serve_while``.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch
from prometheus_client import CollectorRegistry

from stageserve.bench.loadgen import StreamFailed
from stageserve.device import assembly as device_assembly, flags as device_flags
from stageserve.device.backends import create_backend
from stageserve.device.plan_submitter import PlanSubmitter
from stageserve.device.service import DeviceCore
from stageserve.prepare.service import stream_chunk
from stageserve.prepare.engine import Engine
from stageserve.prepare.errors import RequestError
from stageserve.prepare.validation import validate_generate_request
from stageserve.reclaim.completion import CompletionHandler
from stageserve.reclaim.detokenizer import IncrementalDetokenizer, decoder_for
from stageserve.reclaim.device_stream import consume_stream, receive
from stageserve.reclaim.metrics import ReclaimMetrics, StepObserver
from stageserve.tokenizer import load_tokenizer
from stageserve.tracing import Tracer
from stageserve.v1 import device_pb2, prepare_pb2

T = TypeVar("T")


class InProcessPipeline:
    """prepare + device + reclaim in this process (see the module docstring).

    Args:
        model_path: the model (weights for the device, tokenizer for prepare and reclaim).
        device_args: ``stageserve device`` flags (e.g. ``["--dtype", "bfloat16"]``, ``["--backend", "sim"]``).
        max_prefill_chunk, max_waiting: prepare's flags of the same names.
        completion_timeout_s: reclaim's ``--completion-timeout``.

    Raises:
        RuntimeError, ModelLoadError: the device core could not be built (as ``stageserve device`` reports).
    """

    def __init__(self, model_path: Path, device_args: list[str] = (), max_prefill_chunk: int = 512,
                 max_waiting: int = 256, completion_timeout_s: float = 30.0) -> None:
        parser = argparse.ArgumentParser()
        device_flags.add_arguments(parser)
        args = parser.parse_args(list(device_args))
        backend = create_backend("cpu", args.threads, on_caller=True) if args.backend == "cpu" else None
        build = partial(device_assembly.build_core, args, model_path, backend=backend)
        self.core: DeviceCore = backend.serve_while(build) if backend is not None else build()
        self.tokenizer = load_tokenizer(model_path)
        self.engine = Engine(max_prefill_chunk=max_prefill_chunk, max_waiting=max_waiting)
        self._handler = CompletionHandler(self.core.attach_reply, IncrementalDetokenizer(decoder_for(self.tokenizer)), completion_timeout_s)
        self._plans: queue.SimpleQueue[device_pb2.StepPlan | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._submitter = PlanSubmitter(self.core, threading.Lock(), lambda: not self._stopping.is_set())  # opens the "Execute stream"
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._timed_runner = _TimedRunner(self.core.executor.runner, self.core.executor.backend.device)
        self.core.executor.runner = self._timed_runner
        self.engine.start()
        outbox_events = self.core.outbox.events(lambda: not self._stopping.is_set())
        self._threads = [
            threading.Thread(target=self._device_loop, name="inprocess-device", daemon=True),
            threading.Thread(target=receive, args=(outbox_events, self._events), name="inprocess-receive", daemon=True),
            threading.Thread(target=self._reclaim_loop, name="inprocess-reclaim", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        self.engine.attach(self.core.attach_reply, self._plans.put)

    def serve_while(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which sends requests) while this thread runs the device's steps; return its result."""
        return self.core.executor.backend.serve_while(fn)

    def generate_stream(self, request: prepare_pb2.GenerateRequest) -> Iterator[prepare_pb2.GenerateStreamResponse]:
        """What ``Generation.GenerateStream`` yields for ``request``; iterate it inside `serve_while`.

        Raises:
            RequestError: the status the RPC would end with (validation, queue full, failed step).
        """
        request_id = request.request_id or uuid.uuid4().hex
        handle = self.engine.submit(validate_generate_request(request, request_id, self.tokenizer, self.engine.model_limits()))
        try:
            for event in handle.events():
                if (chunk := stream_chunk(request_id, event)) is not None:
                    yield chunk
        finally:
            self.engine.cancel(handle)  # as the servicer's RPC-end callback does

    def device_step_ms(self, rows: int, since: int = 0) -> float | None:
        """Median device stage time (ms) of the steps with ``rows`` sampling rows among steps ``since``.. (see `steps_run`)."""
        times = sorted(seconds for count, seconds in self._timed_runner.stage_seconds(since) if count == rows)
        return times[len(times) // 2] * 1e3 if times else None

    def steps_run(self) -> int:
        """Steps whose device work has run (on cuda/npu: been enqueued) so far; a mark for `device_step_ms`."""
        return len(self._timed_runner.samples)

    def close(self) -> None:
        """Stop the threads and the executor (requests still running fail with ``UNAVAILABLE``)."""
        self.serve_while(self._close)

    def _close(self) -> None:
        self.engine.detach("the in-process pipeline is closing")
        self.engine.stop()
        self._stopping.set()
        self._plans.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self.core.executor.close()

    # ---- the device's Execute handler, as direct calls ----------------------------------------
    def _device_loop(self) -> None:
        while (plan := self._plans.get()) is not None:
            receipt = self._submitter.submit(plan)
            if receipt is None:  # closing
                return
            self.engine.on_receipt(receipt)

    # ---- reclaim's stream loop, as direct calls -------------------------------------------------
    def _reclaim_loop(self) -> None:
        observer = StepObserver(ReclaimMetrics(CollectorRegistry()), Tracer("reclaim"))  # as reclaim's, never scraped or traced
        consume_stream(self._handler, self._events, self.engine.on_step_events, self.core.executor.release, observer)


class _TimedRunner:
    """The executor's step runner, plus the time of each step's device stage by sampling rows.

    On the cpu backend ``run`` is the forward pass and sampling on the compute thread: its wall
    time is the device stage. On cuda/npu ``run`` only enqueues; the stage is the longer of the
    host's enqueue time and the device's execution time between two timing events recorded on
    the compute stream around it. Benchmark instrumentation only.
    """

    def __init__(self, runner, device: torch.device) -> None:
        self._runner = runner
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)
        self.samples: list[tuple[int, float, tuple | None]] = []  # (sampling rows, host seconds, (start, end) events), in step order

    def stage(self, admitted):
        return self._runner.stage(admitted), len(admitted.step.sampled_seq_index)

    def run(self, staged, out):
        inner, rows = staged
        events = None if self._module is None else (self._module.Event(enable_timing=True), self._module.Event(enable_timing=True))
        if events:
            events[0].record()  # run() is called inside the backend's compute-stream context
        start = time.perf_counter()
        result = self._runner.run(inner, out)
        host_s = time.perf_counter() - start
        if events:
            events[1].record()
        self.samples.append((rows, host_s, events))
        return result

    def observe(self, staged, result):
        """The wrapped runner's ``observe`` (structured output's matchers)."""
        return self._runner.observe(staged[0], result)

    def stage_seconds(self, since: int = 0) -> list[tuple[int, float]]:
        """(sampling rows, device stage seconds) of steps ``since``..; waits for their timing events."""
        stages = []
        for rows, host_s, events in self.samples[since:]:
            if events is not None:
                events[1].synchronize()
                host_s = max(host_s, events[0].elapsed_time(events[1]) / 1e3)
            stages.append((rows, host_s))
        return stages


class InProcessTransport:
    """A load-generator `Transport` over an `InProcessPipeline`: one thread per open stream (the
    blocking `RequestHandle.events` consumer; prepare's gRPC handlers await theirs on one event
    loop instead), chunks handed to the event loop."""

    def __init__(self, pipeline: InProcessPipeline) -> None:
        self._pipeline = pipeline

    async def stream(self, request: prepare_pb2.GenerateRequest) -> AsyncIterator[tuple[float, prepare_pb2.GenerateStreamResponse]]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def pump() -> None:
            try:
                for chunk in self._pipeline.generate_stream(request):
                    loop.call_soon_threadsafe(chunks.put_nowait, (time.perf_counter(), chunk))
                item = None
            except RequestError as exc:
                item = StreamFailed(exc.code.name, exc.message)
            loop.call_soon_threadsafe(chunks.put_nowait, item)

        threading.Thread(target=pump, name="inprocess-stream", daemon=True).start()
        while (item := await chunks.get()) is not None:
            if isinstance(item, StreamFailed):
                raise item
            yield item
