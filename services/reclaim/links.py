"""reclaim's links to the devices: their completion streams in, each step's events into the publisher.

:class:`CompletionLink` owns the connection to one device: ``Device.Attach`` (EOS ids, sequence
table, instance id), then the ``Device.Complete`` bidi stream, whose events it feeds (through
:func:`~stageserve.reclaim.device_stream.consume_stream`) to its own
:class:`~stageserve.reclaim.completion.CompletionHandler` (the gRPC-free core: ticket book and
sequence table of that device), publishing each step's ``StepEvents`` (tagged with the device's
instance id) and sending ``SlotRelease`` for each step it has read. A device that is not up is
retried with :class:`~stageserve.backoff.Backoff`; a broken stream fails that device's live
requests with ``UNAVAILABLE`` terminal events (published, so prepare learns) and is re-dialled.

:class:`CompletionLinks` keeps one link per address of ``--device`` (a list, or a ``dns:///`` name
re-resolved every ``--device-refresh-s``; see :mod:`stageserve.device_endpoints`), all publishing
into the one :class:`~stageserve.reclaim.publisher.Publisher`. An address that leaves the DNS
answer keeps its stream until the device ends it (a draining device's last outputs still arrive)
and is not dialled again; one that (re)appears gets a link.

Spans (see :mod:`stageserve.tracing`): ``reclaim.ticket`` (registering a ticket's sequences),
``reclaim.wait`` (ticket held until its output arrives), ``reclaim.detokenize`` (the output's
rows) and ``reclaim.publish``; the metrics are in :mod:`stageserve.reclaim.metrics`.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Callable

import grpc

from stageserve.backoff import Backoff
from stageserve.device_endpoints import DeviceEndpoints, EndpointFollower, Resolver
from stageserve.reclaim.completion import CompletionHandler
from stageserve.reclaim.detokenizer import IncrementalDetokenizer
from stageserve.reclaim.device_stream import StreamEnd, consume_stream, receive
from stageserve.reclaim.metrics import ReclaimMetrics, StepObserver
from stageserve.reclaim.publisher import Publisher
from stageserve.security.tls import TlsFiles, dial
from stageserve.server import GRPC_OPTIONS
from stageserve.tracing import Tracer
from stageserve.v1 import device_pb2, device_pb2_grpc

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 5.0


class CompletionLink:
    """reclaim's connection to one device: attach, run its completion stream, reconnect with backoff while listed.

    Args:
        target: the device's ``HOST:PORT``.
        detokenizer: shared incremental detokenizer.
        publisher: where each step's ``StepEvents`` go.
        completion_timeout_s: see :class:`~stageserve.reclaim.ticket_book.TicketBook`.
        set_attached: called with ``True`` once attached, ``False`` when the stream is lost (on the link's thread).
        tracer: reclaim's tracer (default: one that never records).
        metrics: reclaim's metrics (default: on a private registry nobody scrapes).
        tls: the TLS files the device is dialled with (``None``: plaintext).
    """

    def __init__(
        self,
        target: str,
        detokenizer: IncrementalDetokenizer,
        publisher: Publisher,
        completion_timeout_s: float,
        set_attached: Callable[[bool], None],
        tracer: Tracer | None = None,
        metrics: ReclaimMetrics | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self._tracer = tracer or Tracer("reclaim")
        self._metrics = metrics or ReclaimMetrics(CollectorRegistry())
        self._target = target
        self._detokenizer = detokenizer
        self._publisher = publisher
        self._completion_timeout_s = completion_timeout_s
        self._set_attached = set_attached
        self._channel = dial(target, tls, GRPC_OPTIONS)
        self._stub = device_pb2_grpc.DeviceStub(self._channel)
        self._stopping = threading.Event()
        self._listed = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live = 0  # live sequences, for drain
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="completion-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def live(self) -> int:
        """Requests live on the current device stream."""
        return self._live

    @property
    def finished(self) -> bool:
        """The link's thread ended (stopped, or unlisted and its stream over)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    def set_listed(self, listed: bool) -> None:
        """Whether the address is (still) in the device list; an unlisted link keeps its current
        stream until the device ends it, then its thread ends instead of dialling again."""
        self._listed = listed

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is live (or ``timeout_s`` passes); return whether none is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._live == 0, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what is still live (``UNAVAILABLE``, published), close the stream and end the thread."""
        self._stopping.set()
        self._inbox.put(StreamEnd("reclaim is shutting down"))
        self._thread.join(timeout_s)
        self._channel.close()

    def _run(self) -> None:
        backoff = Backoff(log, f"device {self._target} not reachable")
        while not self._stopping.is_set() and self._listed:
            try:
                attach = self._stub.Attach(device_pb2.AttachRequest(peer="reclaim"), timeout=ATTACH_TIMEOUT_S)
            except grpc.RpcError as exc:
                self._stopping.wait(backoff.refused(exc.code().name))
                continue
            log.info("attached to device %s (instance %s, model %s)", self._target, attach.instance_id, attach.model_name)
            received, reason = self._serve(CompletionHandler(attach, self._detokenizer, self._completion_timeout_s))
            if received:
                backoff.succeeded()
            if not self._stopping.is_set() and self._listed:
                if received:  # news: logged; a stream refused again and again is logged once (Backoff)
                    delay_s = backoff.next_delay()
                    log.warning("device %s stream lost (%s); reconnecting in %.1f s", self._target, reason, delay_s)
                else:
                    delay_s = backoff.refused(f"stream lost before any event ({reason})")
                self._stopping.wait(delay_s)
        if not self._stopping.is_set():
            log.info("device %s left the device list; its link ended", self._target)

    def _serve(self, handler: CompletionHandler) -> tuple[bool, str]:
        """Run one Complete stream until it ends, then fail what is left. Returns (any event received, why it ended)."""
        releases: queue.SimpleQueue = queue.SimpleQueue()
        call = self._stub.Complete(iter(releases.get, None))
        self._inbox = inbox = queue.SimpleQueue()
        threading.Thread(target=receive, args=(call, inbox), name="device-receive", daemon=True).start()
        if self._stopping.is_set():  # stop() may have signalled the previous inbox
            inbox.put(StreamEnd("reclaim is shutting down"))
        self._set_attached(True)
        try:
            received, reason = self._loop(handler, inbox, releases)
        except Exception as exc:  # a bug must not end the link: fail what is live, then reconnect
            log.exception("handling the device stream failed")
            received, reason = True, f"reclaim internal error: {exc!r}"
        self._set_attached(False)
        releases.put(None)
        call.cancel()
        message = f"device {self._target} stream ended ({reason}) with the request in flight"
        for outcome in handler.fail_in_flight(message):
            self._publisher.publish(outcome.events)
        self._note_live(0)
        return received, reason

    def _loop(self, handler: CompletionHandler, inbox: queue.SimpleQueue, releases: queue.SimpleQueue) -> tuple[bool, str]:
        """The main loop over one device stream (`consume_stream`). Returns (any event received, why it ended)."""
        return consume_stream(
            handler, inbox, self._publisher.publish, lambda ticket: releases.put(device_pb2.SlotRelease(ticket=ticket)),
            StepObserver(self._metrics, self._tracer), self._note_live, self._target,
        )

    def _note_live(self, live: int) -> None:
        if live != self._live:
            with self._idle:
                self._live = live
                self._idle.notify_all()


class CompletionLinks:
    """One :class:`CompletionLink` per device address, following ``--device`` (see the module docstring).

    Args:
        endpoints: the parsed ``--device``.
        refresh_s: seconds between DNS lookups of ``dns:///`` entries.
        new_link: builds the link of an address, given the address and the ``set_attached`` callback to pass it.
        on_ready: called with ``True`` while at least one device is attached, ``False`` when none is
            (whenever that changes).
        resolver: ``socket.getaddrinfo`` or a stand-in (tests).
    """

    def __init__(self, endpoints: DeviceEndpoints, refresh_s: float, new_link: Callable[[str, Callable[[bool], None]], CompletionLink],
                 on_ready: Callable[[bool], None], resolver: Resolver = socket.getaddrinfo) -> None:
        self._new_link, self._on_ready = new_link, on_ready
        self._lock = threading.Lock()
        self._links: dict[str, CompletionLink] = {}
        self._attached: set[str] = set()  # addresses whose link is attached
        self._stopping = False
        self._follower = EndpointFollower(endpoints, refresh_s, self._update, resolver)

    def start(self) -> None:
        self._follower.start()

    @property
    def live(self) -> int:
        """Requests live on all device streams."""
        return sum(link.live for link in self._snapshot())

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is live on any device (or ``timeout_s`` passes in all); return whether none is."""
        deadline = time.monotonic() + timeout_s
        return all([link.wait_idle(max(0.0, deadline - time.monotonic())) for link in self._snapshot()])

    def stop(self) -> None:
        """Stop following and stop every link (what is still live fails with ``UNAVAILABLE``)."""
        with self._lock:
            self._stopping = True
        self._follower.stop()
        for link in self._snapshot():
            link.stop()

    def _snapshot(self) -> list[CompletionLink]:
        with self._lock:
            return list(self._links.values())

    def _update(self, addresses: tuple[str, ...]) -> None:
        with self._lock:
            if self._stopping:
                return
            for address, link in list(self._links.items()):
                link.set_listed(address in addresses and not link.finished)
                if link.finished:
                    link.stop()  # closes its channel; its thread is over
                    del self._links[address]
            for address in addresses:
                if address not in self._links:
                    link = self._new_link(address, lambda up, key=address: self._set_attached(key, up))
                    self._links[address] = link
                    link.start()

    def _set_attached(self, address: str, up: bool) -> None:
        """A link attached or lost its stream (its thread; a link at an address ends before the next starts)."""
        with self._lock:
            was_ready = bool(self._attached)
            if up:
                self._attached.add(address)
            else:
                self._attached.discard(address)
            if bool(self._attached) != was_ready:
                self._on_ready(bool(self._attached))
