"""Where a step's device work runs and how its completion is observed: one `Backend` per kind.

The executor gives a backend two callables per step: ``stage`` (build the step's input tensors on
the device: the transient uploads) and ``run`` (placeholder resolution, forward pass, sampling,
device-state updates, and the copy of the sampled ids into the step's slot-local host buffer).
The backend returns a `Completion`; nothing here waits for a step unless asked to.

- ``cpu``: ``stage`` runs in the submitting thread, ``run`` on ONE compute thread (FIFO, so steps
  execute in submission order); the completion is that thread's future. The device service makes
  its process's MAIN thread the compute thread (`CpuBackend.serve_while`): torch's OpenMP intra-op
  pool runs a parallel region from the main thread several times faster than from any other
  thread (a 576 x 1728 bf16 linear: 53 against 148 us on 2 cores, torch 2.13 with libgomp); through
  the three services the bf16 step went from 51 to 36 ms at 1 stream and 84 to 68 ms at 32.
- ``cuda`` / ``npu``: one code path through torch's device-generic module
  (``torch.get_device_module``): both callables enqueue work on one compute stream from the
  submitting thread, host buffers are pinned, copies are ``non_blocking``, and an event recorded
  after the device-to-host copy is the completion (waiting = ``event.synchronize()``).
  ``torch_npu`` is imported only when the ``npu`` backend is created.
- ``sim`` (the simulated device, `stageserve.device.sim`) plugs into the same seam: ``launch``
  returns a completion that is done a set time after the previous step, paired with a step runner
  that writes deterministic ids into the slot; the executor, tickets and slots do not change.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

import torch

from stageserve.device.kernels.thread_governor import ComputeThreadGovernor

BACKENDS = ("cpu", "cuda", "npu")
T = TypeVar("T")


class Completion(Protocol):
    """The end of one launched step's device work (compute and the copy into host buffers)."""

    def wait(self, timeout: float | None) -> bool:
        """Block until the work finished or ``timeout`` seconds passed (``None``: no limit).

        Returns True when finished, False on timeout (the work may still finish later).
        Raises the exception the work failed with; call again after a timeout.
        """
        ...


class FailedCompletion:
    """A completion that failed before anything was launched (e.g. an upload raised)."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def wait(self, timeout: float | None) -> bool:
        raise self._error


class Backend(ABC):
    """Runs steps' device work in submission order and reports each step's completion.

    Attributes:
        name: ``cpu`` | ``cuda`` | ``npu``.
        device: the torch device the model, KV cache and sequence table live on.
    """

    name: str
    device: torch.device

    def stage(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (which builds the step's input tensors) where uploads must be issued; return its result."""
        return fn()

    @abstractmethod
    def launch(self, run: Callable[[], None], rows: int = 0) -> Completion:
        """Start ``run`` after every previously launched step's work; return without waiting for it.

        ``rows``: the step's token rows (prompt chunks, decode tokens, drafts), a hint: the cpu backend
        keeps a thread count per step size.
        Errors ``run`` raises are reported by the returned completion's ``wait``; on stream
        backends an error while enqueueing may also raise here (the executor handles both).
        """

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor the device can copy into asynchronously (pinned on accelerators)."""
        return torch.empty(shape, dtype=dtype)

    def synchronize(self) -> None:
        """Block until all launched work has finished (start-up and shutdown only, never per step)."""

    def close(self) -> None:
        """Stop accepting work and release the backend's threads; launched work finishes first
        (on an ``on_caller`` cpu backend: if a thread is inside `serve_while` to run it)."""

    def serve_while(self, fn: Callable[[], T]) -> T:
        """Return ``fn()``; a backend whose steps run on the calling thread runs them meanwhile."""
        return fn()


class CpuBackend(Backend):
    """Steps run on one compute thread; ``launch`` enqueues and returns at once.

    Args:
        threads: intra-op threads for torch (``torch.set_num_threads``); ``None`` keeps torch's default.
        on_caller: run steps on the thread that calls `serve_while` (the process's main thread, for
            speed: see the module docstring) instead of on a thread of the backend's own. Steps
            launched while no thread is inside `serve_while` wait in the queue.
        adaptive_threads: fewer intra-op threads while other work holds the CPUs
            (`stageserve.device.kernels.thread_governor`); needs ``threads`` > 1. Steps of at most
            ``SMALL_STEP_ROWS`` rows (interactive streams) and larger ones each get a governor of
            their own, the small steps' also trying a thread fewer without contention: at one
            stream the host's own threads need a core more than the step needs a second thread on
            some CPUs and not on others (the governor's docstring). The small steps' governor
            judges over ``SMALL_STEP_WINDOW_S`` windows (a few hundred steps each): an interactive
            user's requests are short, and a wrong choice is undone as quickly.
    """

    name = "cpu"
    # How often an idle caller-side loop returns to Python, so the main thread runs signal handlers.
    _IDLE_WAKE_S = 0.2
    SMALL_STEP_ROWS = 4
    SMALL_STEP_WINDOW_S = 1.0

    def __init__(self, threads: int | None = None, on_caller: bool = False, adaptive_threads: bool = False) -> None:
        self.device = torch.device("cpu")
        if threads:
            torch.set_num_threads(threads)
        self._threads = threads
        self._governors: tuple[ComputeThreadGovernor, ComputeThreadGovernor] | None = None  # small steps', larger ones'
        if adaptive_threads and threads and threads > 1:
            keep = lambda count: None  # noqa: E731 - _run sets the count of the governor whose step runs
            small = ComputeThreadGovernor(threads, window_s=self.SMALL_STEP_WINDOW_S, probe_down=True, set_threads=keep)
            self._governors = (small, ComputeThreadGovernor(threads, set_threads=keep))
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Future[None], int] | None] = queue.SimpleQueue()
        self._thread = None if on_caller else threading.Thread(target=self._loop, name="device-compute", daemon=True)
        if self._thread is not None:
            self._thread.start()

    def launch(self, run: Callable[[], None], rows: int = 0) -> Completion:
        future: Future[None] = Future()
        self._queue.put((run, future, rows))
        return _FutureCompletion(future)

    def synchronize(self) -> None:
        self.launch(lambda: None).wait(None)

    def close(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()

    def serve_while(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on a helper thread and the steps on this one until ``fn`` returns; return its result.

        Only for ``on_caller`` backends (else this is ``fn()``). ``fn``'s exception is re-raised here;
        a ``KeyboardInterrupt`` raised on this thread fails the running step and propagates.
        """
        if self._thread is not None:
            return fn()
        outcome: list = []
        done = threading.Event()

        def control() -> None:
            try:
                outcome.append((True, fn()))
            except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
                outcome.append((False, exc))
            finally:
                done.set()
                self._queue.put(None)  # wake the loop

        helper = threading.Thread(target=control, name="device-control", daemon=True)
        helper.start()
        while not done.is_set():
            try:
                item = self._queue.get(timeout=self._IDLE_WAKE_S)
            except queue.Empty:
                continue
            if item is not None:
                self._run(*item)
                del item
        helper.join()  # its OpenMP workers, if any, are gone before the caller goes on
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)  # some builds keep the setting per thread
        while (item := self._queue.get()) is not None:
            self._run(*item)
            del item  # do not keep the step's inputs alive until the next step arrives

    def _run(self, run: Callable[[], None], future: Future[None], rows: int) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            with torch.inference_mode():
                if self._governors is None:
                    run()
                else:
                    governor = self._governors[rows > self.SMALL_STEP_ROWS]
                    if torch.get_num_threads() != governor.threads:
                        torch.set_num_threads(governor.threads)  # this thread's OpenMP team, between steps
                    governor.run(run)
        except BaseException as exc:  # noqa: BLE001 - every failure belongs to its step
            future.set_exception(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise  # Ctrl-C on the main thread stops the caller too
        else:
            future.set_result(None)


class _FutureCompletion:
    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self, timeout: float | None) -> bool:
        try:
            self._future.result(timeout)
        except TimeoutError:
            if not self._future.done():
                return False
            raise
        return True


class StreamBackend(Backend):
    """CUDA or Ascend NPU: one compute stream, pinned host buffers, an event per step.

    Args:
        name: ``cuda`` or ``npu``.
        index: device ordinal.

    Raises:
        RuntimeError: the device (or ``torch_npu`` for ``npu``) is not available; the message says which.
    """

    # How often a timed wait polls the event; only the completion thread and reclaim-side timeouts use it.
    _POLL_S = 0.0002

    def __init__(self, name: str, index: int = 0) -> None:
        if name == "npu":
            try:
                importlib.import_module("torch_npu")  # registers torch.npu
            except ImportError as exc:
                raise RuntimeError("--backend npu needs torch_npu (pip install 'stageserve[npu]' and the Ascend CANN toolkit)") from exc
        self._module = torch.get_device_module(name)
        if not self._module.is_available():
            raise RuntimeError(f"--backend {name}: no {name} device is available to torch")
        self.name = name
        self.device = torch.device(name, index)
        self._module.set_device(self.device)
        self._stream = self._module.Stream(self.device)

    def stage(self, fn: Callable[[], T]) -> T:
        # Uploads go on the compute stream so the step's kernels are ordered after them.
        with self._module.stream(self._stream):
            return fn()

    def launch(self, run: Callable[[], None], rows: int = 0) -> Completion:
        # Work issued on the default stream (weights, KV pool, sequence table set-up) comes first.
        self._stream.wait_stream(self._module.default_stream(self.device))
        with self._module.stream(self._stream), torch.inference_mode():
            run()
            event = self._module.Event()
            event.record(self._stream)
        return _EventCompletion(event)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        self._module.synchronize(self.device)


class _EventCompletion:
    def __init__(self, event: torch.Event) -> None:
        self._event = event

    def wait(self, timeout: float | None) -> bool:
        if timeout is None:
            self._event.synchronize()
            return True
        deadline = time.monotonic() + timeout
        while not self._event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(StreamBackend._POLL_S)
        return True


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (nested) host list as a tensor on ``device``; through pinned memory and non-blocking on accelerators.

    The pinned staging buffer comes from torch's caching host allocator, which keeps it until
    the copy has run, so the caller need not hold it.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def create_backend(name: str, threads: int | None = None, on_caller: bool = False, adaptive_threads: bool = False) -> Backend:
    """Create the backend ``name`` (one of `BACKENDS`).

    Args:
        threads: torch intra-op threads (``cpu``; also the host threads of accelerator backends).
        on_caller: ``cpu`` only: steps run on the thread inside `Backend.serve_while` (see `CpuBackend`).
        adaptive_threads: ``cpu`` only: see `CpuBackend`.

    Raises:
        ValueError: unknown name.
        RuntimeError: the device is not available (message names the flag and what is missing).
    """
    if name == "cpu":
        return CpuBackend(threads, on_caller, adaptive_threads)
    if name in ("cuda", "npu"):
        if threads:
            torch.set_num_threads(threads)
        return StreamBackend(name)
    raise ValueError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}")
