"""Fan-out of StepEvents: every subscriber gets every step in order; a lagging one is dropped, not waited for."""

from __future__ import annotations

import threading

import pytest

from stageserve.reclaim.publisher import Publisher, TooManySubscribers
from stageserve.v1 import reclaim_pb2


def subscriber_count(publisher: Publisher) -> int:
    """Subscriptions the publisher still delivers to (read from its list: no production code needs the count)."""
    with publisher._lock:
        return len(publisher._subscribers)


def steps(*ids: int) -> list[reclaim_pb2.StepEvents]:
    return [reclaim_pb2.StepEvents(step_id=i, ticket=i) for i in ids]


def test_every_subscriber_gets_every_step_in_order_until_close():
    publisher = Publisher(max_queued_steps=8)
    a, b = publisher.subscribe("a"), publisher.subscribe("b")
    for events in steps(1, 2, 3):
        publisher.publish(events)
    publisher.close()
    assert [e.step_id for e in a] == [1, 2, 3]
    assert [e.step_id for e in b] == [1, 2, 3]
    assert a.drop_reason == "" and subscriber_count(publisher) == 0


def test_lagging_subscriber_is_dropped_without_blocking_the_others():
    publisher = Publisher(max_queued_steps=2)
    slow, fast = publisher.subscribe("slow"), publisher.subscribe("fast")
    received = []
    reader = threading.Thread(target=lambda: received.extend(e.step_id for e in fast))
    reader.start()
    for events in steps(1, 2):
        publisher.publish(events)
    while len(received) < 2:  # let "fast" catch up; "slow" never reads
        threading.Event().wait(0.01)
    publisher.publish(steps(3)[0])  # "slow" has 2 queued: dropped here
    assert subscriber_count(publisher) == 1
    assert "2 steps behind" in slow.drop_reason
    assert list(slow) == []  # its queue is discarded and its stream ends at once
    publisher.publish(steps(4)[0])
    publisher.close()
    reader.join(5)
    assert received == [1, 2, 3, 4]


def test_unsubscribe_ends_the_stream_and_later_steps_skip_it():
    publisher = Publisher(max_queued_steps=4)
    gone = publisher.subscribe("gone")
    publisher.unsubscribe(gone)
    publisher.publish(steps(1)[0])
    assert list(gone) == [] and subscriber_count(publisher) == 0


def test_subscribe_after_close_ends_at_once():
    publisher = Publisher(max_queued_steps=4)
    publisher.close()
    assert list(publisher.subscribe("late")) == []


def test_subscribers_beyond_the_bound_are_refused_until_one_leaves():
    publisher = Publisher(max_queued_steps=4, max_subscribers=2)
    first, _ = publisher.subscribe("a"), publisher.subscribe("b")
    with pytest.raises(TooManySubscribers, match="2 subscribers already \\(--max-subscribers\\)"):
        publisher.subscribe("c")
    publisher.unsubscribe(first)
    assert publisher.subscribe("c").peer == "c"
