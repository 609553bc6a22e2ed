"""Per-process span recorder writing Chrome-trace JSON that Perfetto (ui.perfetto.dev) loads.

Each service owns one :class:`Tracer`. It is disabled until :meth:`Tracer.start`; while disabled,
``with tracer.span(...)`` costs one attribute check and returns a shared no-op span, so spans stay
on the per-step hot path. :meth:`Tracer.stop` writes the window to
``<trace_dir>/<service>-<pid>.trace.json``; ``stageserve trace merge`` combines the fragments of
all services into one file and ``stageserve trace analyze`` turns it into step figures.

Clock: ``time.monotonic_ns()`` (Linux ``CLOCK_MONOTONIC``), one clock for every process of a host,
so the fragments of prepare, device and reclaim line up without any offset. Event times are
written in microseconds (``ts``, ``dur``), as the Trace Event Format asks.

Span names (the contract between the services and the analyzer; ``args`` in brackets):

========================  =====================================================================
``prepare.schedule``      scheduler picks the rows of step ``step_id`` (step_id, batch_size,
                          prefill_tokens, decode_tokens)
``prepare.build_plan``    builds the ``StepPlan`` message (step_id)
``prepare.send``          hands the plan to the Execute stream (step_id)
``device.upload``         copies the plan's inputs to the accelerator (step_id)
``device.submit``         launches forward + sampling without waiting (step_id, ticket,
                          batch_size); ends when the ticket exists, BEFORE the ticket is handed
                          to the completion thread (the analyzer rejects a wait starting earlier)
``device.wait``           completion thread, from taking up the ticket until the step's completion
                          is observed (step_id, ticket); paired with ``device.submit`` by ticket
``device.copy_out``       sampled ids into the slot's host buffer (step_id, ticket)
``device.blocking_step``  ``--dispatch sync`` only: ONE span from submit to completion instead
                          of submit/wait (step_id, ticket, timing_source="blocking_span")
``reclaim.ticket``        registers the sequences a ticket starts; off the critical path, while
                          the device runs the step (step_id, ticket)
``reclaim.wait``          reclaim holds a ticket until its output arrives (step_id, ticket, slot);
                          on a virtual lane per output slot, as consecutive waits overlap
``reclaim.detokenize``    token append, incremental detokenization, stop checks (step_id, ticket)
``reclaim.publish``       one ``StepEvents`` message to the subscribers (step_id, ticket)
``request.queue``         async span, id = request id: accepted until first scheduled
``request.ttft``          async span, id = request id: accepted until first token forwarded
``request.total``         async span, id = request id: accepted until the terminal message
``request.token``         async instant, id = request id: a chunk with new tokens forwarded to
                          the client (tokens = how many); the gaps give the inter-token latency
========================  =====================================================================

``step_id`` is the ``StepPlan.step_id``, ``ticket`` the completion ticket id. Optional args the
analyzer reads when present: ``accepted_tokens`` and ``draft_tokens``
(speculative / MTP acceptance) on any span of a step.

Spans on one thread id must nest (Perfetto draws one thread as a stack); spans measured elsewhere
go through :meth:`Tracer.complete`, optionally on a named virtual lane (:meth:`Tracer.name_lane`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

# The one clock of every span; callers of Tracer.complete() measure with it too.
clock_ns = time.monotonic_ns

# ~100 B per stored tuple plus args: the default cap bounds a window to roughly 100-200 MB.
DEFAULT_MAX_EVENTS = 1_000_000

FRAGMENT_SUFFIX = ".trace.json"

# Stored event tuple: (ph, name, ts_ns, dur_ns, tid, args, async_id); formatted only at stop().
_PH_COMPLETE = "X"
_PH_INSTANT = "i"
_PH_ASYNC_BEGIN = "b"
_PH_ASYNC_END = "e"
_PH_ASYNC_INSTANT = "n"


class _NoopSpan:
    """What :meth:`Tracer.span` returns while disabled: enter/exit/set do nothing."""

    __slots__ = ()

    def __enter__(self) -> _NoopSpan:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def set(self, **args: Any) -> None:
        """Ignored while disabled."""


_NOOP_SPAN = _NoopSpan()


class Span:
    """A running complete-event span (``ph: X``); made by :meth:`Tracer.span`, never directly."""

    __slots__ = ("_tracer", "_name", "_args", "_start_ns")

    def __init__(self, tracer: Tracer, name: str, args: dict[str, Any]) -> None:
        self._tracer = tracer
        self._name = name
        self._args = args
        self._start_ns = 0

    def __enter__(self) -> Span:
        self._start_ns = clock_ns()
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        end_ns = clock_ns()
        if exc_type is not None:
            self._args["error"] = exc_type.__name__
        tracer = self._tracer
        start_ns = self._start_ns
        tracer._append((_PH_COMPLETE, self._name, start_ns, end_ns - start_ns, tracer._tid(), self._args, None))

    def set(self, **args: Any) -> None:
        """Add args known only inside the span (e.g. the ``ticket`` a submit returned)."""
        self._args.update(args)


class Tracer:
    """Span recorder of one service process; thread-safe, bounded, disabled until :meth:`start`.

    Args:
        service: the process label in Perfetto and the file-name prefix (``"prepare"``,
            ``"device"``, ``"reclaim"``).
        max_events: events kept per window; later ones are counted in :attr:`dropped` and in the
            file's ``otherData.dropped_events`` (the analyzer warns, as pairs may then be missing).

    Attributes:
        enabled: True between :meth:`start` and :meth:`stop`; a plain bool, read lock-free on the
            hot path.
        dropped: events refused in the current window because the cap was reached.
    """

    def __init__(self, service: str, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.service = service
        self.enabled = False
        self.dropped = 0
        self._max_events = max_events
        self._lock = threading.Lock()
        self._events: list[tuple] = []
        self._thread_names: dict[int, str] = {}
        self._trace_dir: Path | None = None
        self._window_start_ns = 0
        self._windows_written: dict[Path, int] = {}
        self._local = threading.local()  # per-thread cached tid (get_native_id() is a syscall)

    # -- window control ------------------------------------------------------------------------

    def start(self, trace_dir: str | os.PathLike[str]) -> None:
        """Start recording a window whose file goes into ``trace_dir`` (created if missing).

        Raises:
            RuntimeError: the tracer is already recording.
            OSError: ``trace_dir`` cannot be created.
        """
        path = Path(trace_dir)
        path.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self.enabled:
                raise RuntimeError(f"tracer of {self.service!r} is already recording into {self._trace_dir}")
            self._events = []
            self.dropped = 0
            self._trace_dir = path
            self._window_start_ns = clock_ns()
            self.enabled = True

    def stop(self) -> Path:
        """Stop recording and write the window; returns the written file.

        The first window of this process in a folder is ``<service>-<pid>.trace.json``; later
        windows into the same folder get ``-w2``, ``-w3``, ... before the suffix, so repeated
        start/stop windows never overwrite each other. The file is written to a temporary name
        and renamed, so ``merge`` never reads half a file.

        Raises:
            RuntimeError: the tracer is not recording.
            OSError: the file cannot be written.
        """
        with self._lock:
            if not self.enabled:
                raise RuntimeError(f"tracer of {self.service!r} is not recording; call start() first")
            self.enabled = False
            events, self._events = self._events, []
            thread_names = dict(self._thread_names)
            trace_dir = self._trace_dir
            dropped = self.dropped
        assert trace_dir is not None
        window_end_ns = clock_ns()
        window = self._windows_written.get(trace_dir, 0) + 1
        self._windows_written[trace_dir] = window
        pid = os.getpid()
        suffix = "" if window == 1 else f"-w{window}"
        out = trace_dir / f"{self.service}-{pid}{suffix}{FRAGMENT_SUFFIX}"
        document = {
            "traceEvents": self._format(events, thread_names, pid),
            "displayTimeUnit": "ms",
            "otherData": {
                "service": self.service,
                "pid": pid,
                "clock": "CLOCK_MONOTONIC",
                "window_start_us": self._window_start_ns / 1000,
                "window_end_us": window_end_ns / 1000,
                "dropped_events": dropped,
                "max_events": self._max_events,
            },
        }
        tmp = trace_dir / f".{out.name}.tmp"
        tmp.write_text(json.dumps(document, default=_json_default))
        tmp.replace(out)
        return out

    # -- recording -----------------------------------------------------------------------------

    def span(self, name: str, **args: Any) -> Span | _NoopSpan:
        """Context manager timing its block as one complete event on the calling thread.

        ``args`` (JSON-serializable; numpy scalars are converted) go to the event's ``args``; more
        can be added inside the block with ``.set(**args)``. An exception leaving the block is
        recorded as ``args.error`` (its type name) and propagates unchanged.
        """
        if not self.enabled:
            return _NOOP_SPAN
        return Span(self, name, args)

    def complete(self, name: str, start_ns: int, end_ns: int, tid: int | None = None, **args: Any) -> None:
        """Record a span measured elsewhere, in :func:`clock_ns` nanoseconds.

        Args:
            start_ns, end_ns: span bounds from ``clock_ns()`` (``time.monotonic_ns``).
            tid: the lane to draw it on: another thread's ``native_id`` or a virtual lane named
                with :meth:`name_lane`; default the calling thread. Spans on one lane must nest.
        """
        if not self.enabled:
            return
        self._append(
            (_PH_COMPLETE, name, start_ns, end_ns - start_ns,
             self._tid() if tid is None else tid, args, None)
        )

    def instant(self, name: str, **args: Any) -> None:
        """Record a thread-scoped instant event (``ph: i``) now."""
        if not self.enabled:
            return
        self._append((_PH_INSTANT, name, clock_ns(), 0, self._tid(), args, None))

    def begin_async(self, name: str, request_id: str | int, **args: Any) -> None:
        """Begin an async span (``ph: b``) keyed by ``request_id``, e.g. ``request.ttft``.

        Its :meth:`end_async` must come from the same process with the same name and id
        (Perfetto matches b/e by process, category, name and id).
        """
        if not self.enabled:
            return
        self._append((_PH_ASYNC_BEGIN, name, clock_ns(), 0, self._tid(), args, request_id))

    def end_async(self, name: str, request_id: str | int, **args: Any) -> None:
        """End the async span ``name`` of ``request_id`` (``ph: e``); ``args`` are merged into it."""
        if not self.enabled:
            return
        self._append((_PH_ASYNC_END, name, clock_ns(), 0, self._tid(), args, request_id))

    def instant_async(self, name: str, request_id: str | int, **args: Any) -> None:
        """An instant on the async track of ``request_id`` (``ph: n``), e.g. ``request.token``."""
        if not self.enabled:
            return
        self._append((_PH_ASYNC_INSTANT, name, clock_ns(), 0, self._tid(), args, request_id))

    def name_lane(self, tid: int, name: str) -> None:
        """Name a lane (a thread id, or a virtual one used with :meth:`complete`) in the trace."""
        with self._lock:
            self._thread_names[tid] = name

    # -- internals -----------------------------------------------------------------------------

    def _tid(self) -> int:
        """The calling thread's native id; its name is registered on first use."""
        try:
            return self._local.tid
        except AttributeError:
            tid = self._local.tid = threading.get_native_id()
            with self._lock:
                self._thread_names[tid] = threading.current_thread().name
            return tid

    def _append(self, event: tuple) -> None:
        with self._lock:
            if not self.enabled:  # a span that began before stop() ends after it
                return
            if len(self._events) >= self._max_events:
                self.dropped += 1
                return
            self._events.append(event)

    def _format(self, events: list[tuple], thread_names: dict[int, str], pid: int) -> list[dict[str, Any]]:
        """Stored tuples -> Trace Event Format dicts, metadata (``ph: M``) first."""
        for thread in threading.enumerate():  # live names win (renamed threads, recycled tids)
            if thread.native_id is not None:
                thread_names[thread.native_id] = thread.name
        used_tids = {event[4] for event in events}
        formatted: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self.service}}
        ]
        formatted += [
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread_names[tid]}}
            for tid in sorted(used_tids & thread_names.keys())
        ]
        for ph, name, ts_ns, dur_ns, tid, args, async_id in events:
            event: dict[str, Any] = {
                "ph": ph, "name": name, "cat": name.partition(".")[0],
                "ts": ts_ns / 1000, "pid": pid, "tid": tid, "args": args,
            }
            if ph == _PH_COMPLETE:
                event["dur"] = dur_ns / 1000
            elif ph == _PH_INSTANT:
                event["s"] = "t"
            else:
                event["id"] = str(async_id)
            formatted.append(event)
        return formatted


def _json_default(value: Any) -> Any:
    """numpy / torch scalars -> Python numbers; anything else -> its str()."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)
