"""``RequestHandle``: events put by engine threads reach a thread (``events``) or a coroutine
(``events_async``) in order, end at the finish or the client-gone mark, and raise a terminal error;
``LoopWaker`` wakes the event loop once for a burst of puts."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from stageserve.prepare.request_handle import LoopWaker, RequestHandle
from stageserve.prepare.errors import RequestError
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import common_pb2, reclaim_pb2

STREAMS, STEPS = 32, 20


def event(token: int, finish: bool = False) -> reclaim_pb2.SequenceEvent:
    return reclaim_pb2.SequenceEvent(token_ids=[token], finish_reason=common_pb2.FINISH_REASON_LENGTH if finish else 0)


def new_handle() -> RequestHandle:
    request = GenerationRequest("r", [1, 2], 64, common_pb2.SamplingParams(), common_pb2.StopParams(max_tokens=64))
    return RequestHandle(request=request, observer=None, accepted_ns=0)  # the handle's queue does not look at the observer


def in_thread(fn) -> None:
    """Run ``fn`` on another thread and wait for it (here: while the event loop is blocked)."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join(10)


def test_async_consumers_get_their_events_in_order_with_one_wakeup_per_burst():
    """32 streams, 20 steps: a step's puts (from another thread) all land while the loop cannot
    run, so the loop is woken once per step, not once per stream."""

    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        wakeups = 0
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakeups
            wakeups += 1
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counting
        waker = LoopWaker(loop)
        handles = [new_handle() for _ in range(STREAMS)]
        received: list[list[int]] = [[] for _ in range(STREAMS)]

        async def consume(i: int) -> None:
            async for e in handles[i].events_async(waker):
                received[i].append(e.token_ids[0])

        tasks = [asyncio.create_task(consume(i)) for i in range(STREAMS)]
        await asyncio.sleep(0)  # each consumer runs until it waits, armed
        for step in range(STEPS):
            while any(len(got) < step for got in received):  # every consumer waits again
                await asyncio.sleep(0)
            in_thread(lambda: [h.put(event(1000 * i + step, finish=step == STEPS - 1)) for i, h in enumerate(handles)])
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return received, wakeups

    received, wakeups = asyncio.run(main())
    assert received == [[1000 * i + step for step in range(STEPS)] for i in range(STREAMS)]
    assert wakeups == STEPS


def test_async_consumer_takes_what_came_before_it_waited_and_stops_at_the_finish():
    async def main() -> list[int]:
        handle = new_handle()
        for token in (1, 2, 3):
            handle.put(event(token))
        handle.put(event(4, finish=True))
        handle.put(event(5))  # after the finish: never read
        return [e.token_ids[0] async for e in handle.events_async(LoopWaker(asyncio.get_running_loop()))]

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_async_consumer_ends_when_the_client_is_gone_and_raises_the_terminal_error():
    async def main() -> None:
        waker = LoopWaker(asyncio.get_running_loop())
        gone, failed = new_handle(), new_handle()
        gone.put(event(1))
        in_thread(gone.client_gone)
        assert [e.token_ids[0] async for e in gone.events_async(waker)] == [1]

        failed.put(event(1))
        threading.Timer(0.05, failed.put, [RequestError(grpc.StatusCode.UNAVAILABLE, "device lost")]).start()
        with pytest.raises(RequestError) as error:
            async for _ in failed.events_async(waker):
                pass
        assert error.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_cancelled_consumer_or_a_closed_loop_does_not_trouble_the_engine_thread():
    handle = new_handle()

    async def main() -> tuple[list[dict], list[int]]:
        loop = asyncio.get_running_loop()
        loop_errors: list[dict] = []
        loop.set_exception_handler(lambda _, context: loop_errors.append(context))
        waker = LoopWaker(loop)
        task = asyncio.create_task(anext(aiter(handle.events_async(waker))))
        await asyncio.sleep(0.01)  # it waits, armed
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        in_thread(lambda: handle.put(event(1, finish=True)))  # resolves nothing: the future was cancelled
        await asyncio.sleep(0.01)
        return loop_errors, [e.token_ids[0] async for e in handle.events_async(waker)]

    loop_errors, later = asyncio.run(main())
    assert loop_errors == [] and later == [1]  # no error on the loop, and the event is not lost

    closed = asyncio.new_event_loop()
    closed.close()
    assert LoopWaker(closed).wake(None) is None  # the loop is gone: nothing to wake, no error for the caller


def test_sync_consumer_blocks_until_events_arrive():
    handle = new_handle()

    def produce() -> None:
        for token in range(50):
            handle.put(event(token, finish=token == 49))

    producer = threading.Timer(0.05, produce)
    producer.start()
    assert [e.token_ids[0] for e in handle.events()] == list(range(50))
    gone = new_handle()
    threading.Timer(0.05, gone.client_gone).start()
    assert list(gone.events()) == []


class _PutOnceArmed:
    """The handle's lock, which puts ``item`` the first time it is released with the consumer's
    wake-up armed: the put lands between the consumer finding no item and its next look."""

    def __init__(self, handle: RequestHandle, item: reclaim_pb2.SequenceEvent) -> None:
        self._inner, self._handle, self._item = threading.Lock(), handle, item

    def __enter__(self) -> None:
        self._inner.acquire()

    def __exit__(self, *exc) -> None:
        self._inner.release()
        if self._handle._wake is not None and self._item is not None:
            item, self._item = self._item, None
            self._handle.put(item)


def test_an_event_put_just_after_the_consumer_found_none_is_delivered_once():
    """Seen once on a loaded machine (a resumed stream got one token twice): the consumer found the
    queue empty and armed its wake-up; a put landed before it looked again; the event went out
    through the consumer's reference to the queue and again from the queue, which still held it
    (or, here, the queue grew while the consumer iterated it)."""
    handle = new_handle()
    handle._lock = _PutOnceArmed(handle, event(7))
    consumer = handle._events_or_waits(lambda: None)
    first = next(consumer)  # found none and armed the wake-up; the put landed on the way out
    handle.put(event(8, finish=True))
    assert [e.token_ids[0] for e in [first, *consumer] if e is not None] == [7, 8]
