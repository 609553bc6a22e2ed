"""Fan-out of ``StepEvents`` to every ``Reclaim.Subscribe`` stream.

Each subscriber has a bounded queue. :meth:`Publisher.publish` never blocks: a subscriber whose
queue is full (slow or dead) is dropped with a log line and its stream ends with
``RESOURCE_EXHAUSTED``, so it can neither stall the others nor the device stream. The same
``StepEvents`` object goes to every subscriber and must not be changed after publishing. At most
``max_subscribers`` subscribe at once (``--max-subscribers``): each costs a queue and a copy of
every step, so a further one is refused (:class:`TooManySubscribers`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Iterator

from stageserve.v1 import reclaim_pb2

log = logging.getLogger(__name__)


class Subscription:
    """One subscriber's queue of published steps; iterate it to stream them.

    Iteration ends when the subscription is closed: after the queued steps on a normal close,
    at once when the subscriber was dropped (then :attr:`drop_reason` says why).
    """

    def __init__(self, peer: str, max_queued_steps: int) -> None:
        self.peer = peer
        self.drop_reason = ""
        self._max_queued = max_queued_steps
        self._queue: deque[reclaim_pb2.StepEvents] = deque()
        self._closed = False
        self._cond = threading.Condition()

    def offer(self, events: reclaim_pb2.StepEvents) -> bool:
        """Queue ``events`` without blocking; ``False`` when the queue is full."""
        with self._cond:
            if len(self._queue) >= self._max_queued:
                return False
            self._queue.append(events)
            self._cond.notify()
            return True

    def close(self, drop_reason: str = "") -> None:
        """End the stream: after the queued steps, or at once (queue discarded) with a ``drop_reason``."""
        with self._cond:
            self._closed = True
            if drop_reason:
                self.drop_reason = drop_reason
                self._queue.clear()
            self._cond.notify_all()

    def __iter__(self) -> Iterator[reclaim_pb2.StepEvents]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                events = self._queue.popleft()
            yield events


class TooManySubscribers(Exception):
    """``max_subscribers`` are subscribed already; the message says so and names the flag."""


class Publisher:
    """Publishes each step's ``StepEvents`` to every current subscriber.

    Args:
        max_queued_steps: steps a subscriber may lag behind before it is dropped.
        max_subscribers: subscribers at once at most.

    Thread-safe: subscribers come and go on gRPC threads, steps are published from the device loop.
    """

    def __init__(self, max_queued_steps: int, max_subscribers: int = 16) -> None:
        self._max_queued = max_queued_steps
        self._max_subscribers = max_subscribers
        self._subscribers: list[Subscription] = []
        self._lock = threading.Lock()
        self._closed = False

    def subscribe(self, peer: str) -> Subscription:
        """A new subscription, receiving every step published from now on (closed at once after :meth:`close`).

        Raises:
            TooManySubscribers: ``max_subscribers`` are subscribed already.
        """
        subscription = Subscription(peer, self._max_queued)
        with self._lock:
            if len(self._subscribers) >= self._max_subscribers:
                raise TooManySubscribers(f"{self._max_subscribers} subscribers already (--max-subscribers); retry when one has left")
            if self._closed:
                subscription.close()
            else:
                self._subscribers.append(subscription)
        log.info("subscriber %s joined (%d now)", peer, len(self._subscribers))
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Remove ``subscription`` (its client left); ends its iteration."""
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)
                log.info("subscriber %s left (%d now)", subscription.peer, len(self._subscribers))
        subscription.close()

    def publish(self, events: reclaim_pb2.StepEvents) -> None:
        """Queue ``events`` for every subscriber; drop those whose queue is full. Never blocks on a subscriber."""
        with self._lock:
            subscribers = tuple(self._subscribers)
        for subscription in subscribers:
            if not subscription.offer(events):
                reason = f"subscriber fell {self._max_queued} steps behind (--subscriber-queue-steps); dropped"
                log.warning("subscriber %s %s at step %d", subscription.peer, reason, events.step_id)
                with self._lock:
                    if subscription in self._subscribers:
                        self._subscribers.remove(subscription)
                subscription.close(drop_reason=reason)

    def close(self) -> None:
        """End every subscription after its queued steps (shutdown); later subscriptions end at once."""
        with self._lock:
            self._closed = True
            subscribers, self._subscribers = self._subscribers, []
        for subscription in subscribers:
            subscription.close()
