"""reclaim's Prometheus metrics and its per-step trace spans.

:class:`StepObserver` is what the device-stream loop calls around its work; it keeps the
ticket-arrival times that give both the ``reclaim.wait`` span and the completion-wait histogram.

- ``stageserve_completion_wait_seconds``: a ticket's arrival -> its step output's arrival (how long
  reclaim held the ticket: the device time seen from reclaim).
- ``stageserve_host_critical_path_seconds``: reclaim's host work per step on the critical path:
  token append, detokenization and stop checks, plus publishing (``reclaim.detokenize`` +
  ``reclaim.publish``).
- ``stageserve_steps_published_total{outcome}``: ``ok`` or ``failed`` (device error, completion
  timeout, lost stream).
- ``stageserve_requests_live``: sequences registered and not yet finished.

``reclaim.wait`` spans of consecutive steps overlap (several tickets are held at once), so each
goes on a virtual trace track per output slot; one slot holds one step at a time.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from stageserve.metric_buckets import STEP_HOST_BUCKETS_S
from stageserve.tracing import Tracer, clock_ns
from stageserve.v1 import device_pb2, reclaim_pb2

# Seconds a ticket is held: about one to a few step periods.
WAIT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 10.0, 30.0)
# Virtual trace tracks of reclaim.wait: far above any Linux thread id (pid_max <= 2**22).
WAIT_TRACK_BASE = 1 << 30


class ReclaimMetrics:
    """reclaim's metric families on ``registry`` (a per-service registry, never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.completion_wait = Histogram("stageserve_completion_wait_seconds", "A ticket's arrival until its step output's arrival",
                                         buckets=WAIT_BUCKETS_S, registry=registry)
        self.step_host = Histogram("stageserve_host_critical_path_seconds",
                                   "reclaim's host work per step on the critical path: detokenize + stop checks + publish",
                                   buckets=STEP_HOST_BUCKETS_S, registry=registry)
        self.steps_published = Counter("stageserve_steps_published", "Steps published to subscribers, by outcome",
                                       ["outcome"], registry=registry)
        self._live = Gauge("stageserve_requests_live", "Sequences registered by reclaim and not yet finished", registry=registry)

    def watch_live(self, live: Callable[[], int]) -> None:
        """Read the live-sequence gauge from ``live()`` at every scrape."""
        self._live.set_function(live)


class StepObserver:
    """Spans and metrics of one device stream's steps, in the loop's order of calls.

    Not thread-safe: the device-stream loop owns it. Its ticket book is bounded by the tickets in
    flight (entries leave with their output, or with the observer at the end of the stream).
    """

    def __init__(self, metrics: ReclaimMetrics, tracer: Tracer) -> None:
        self._metrics, self._tracer = metrics, tracer
        self._arrived: dict[int, tuple[int, int, int]] = {}  # ticket -> (clock_ns at arrival, step_id, slot)
        self._named_tracks: set[int] = set()

    def handling(self, event: device_pb2.CompletionEvent | None, now_ns: int) -> AbstractContextManager:
        """Note the arrival of a device ``event`` (``None``: a completion deadline passed) at
        ``now_ns`` and return the span to handle it in: ``reclaim.ticket`` or ``reclaim.detokenize``."""
        kind = None if event is None else event.WhichOneof("kind")
        if kind == "ticket":
            ticket = event.ticket
            self._arrived[ticket.ticket] = (now_ns, ticket.step_id, ticket.slot)
            return self._tracer.span("reclaim.ticket", step_id=ticket.step_id, ticket=ticket.ticket)
        if kind == "output":
            output = event.output
            self._end_wait(output, now_ns)
            return self._tracer.span("reclaim.detokenize", step_id=output.step_id, ticket=output.ticket)
        return nullcontext()

    def handled(self, event: device_pb2.CompletionEvent | None, start_ns: int) -> None:
        """``event`` and the publications it led to are done: an output's host time since ``start_ns``."""
        if event is not None and event.WhichOneof("kind") == "output":
            self._metrics.step_host.observe((clock_ns() - start_ns) / 1e9)

    def _end_wait(self, output: device_pb2.StepOutput, now_ns: int) -> None:
        """Ends the ticket's ``reclaim.wait`` (a span on the slot's trace track) and observes the wait."""
        arrival = self._arrived.pop(output.ticket, None)
        if arrival is None:
            return
        start_ns, step_id, slot = arrival
        self._metrics.completion_wait.observe((now_ns - start_ns) / 1e9)
        tracer = self._tracer
        if tracer.enabled:
            track = WAIT_TRACK_BASE + slot
            if track not in self._named_tracks:
                self._named_tracks.add(track)
                tracer.name_lane(track, f"reclaim.wait slot {slot}")
            tracer.complete("reclaim.wait", start_ns, now_ns, tid=track, step_id=step_id, ticket=output.ticket, slot=slot)

    def publishing(self, events: reclaim_pb2.StepEvents) -> AbstractContextManager:
        """The span to publish ``events`` in: ``reclaim.publish``."""
        return self._tracer.span("reclaim.publish", step_id=events.step_id, ticket=events.ticket)

    def published(self, events: reclaim_pb2.StepEvents) -> None:
        """One ``StepEvents`` went to the subscribers."""
        self._metrics.steps_published.labels("failed" if events.error_code else "ok").inc()

