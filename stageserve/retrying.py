"""A streamed generation that survives the loss of the prepare replica serving it.

Several prepare replicas serve one deployment (docs/deploy.md, "Replicas"). A draining replica
refuses new requests with ``UNAVAILABLE`` and a ``google.rpc.RetryInfo`` delay; a replica that dies
breaks its streams with ``UNAVAILABLE``; a call that reaches a replica in the instant its gRPC
server stops, before a handler took it, ends ``CANCELLED`` (gRPC core's behaviour, grpc/grpc#41785).
gRPC's own retry policy retries a call only until response headers arrived, so it never retries a
stream broken mid-way. :func:`stream_generation` retries the whole call on either code (after the
RetryInfo delay when the status carries one, else with exponential backoff) and hands on only what the earlier attempts did not deliver yet: the caller
sees every character, token and tool call once, and one final chunk per choice.

That is exact when the retried call reproduces the earlier output: greedy or seeded sampling on
the same model and dtype (counter-based seeds: replica and batch do not matter in float32).
:func:`reproducible` gives a sampled request without a seed one of its own, which keeps its
distribution. A retry that does not reproduce what was delivered raises :class:`RetryDiverged`.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Callable, Iterator, Sequence

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from stageserve.backoff import Backoff
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

log = logging.getLogger(__name__)

RETRY_ATTEMPTS = 5  # calls in all; a replica's loss costs one, a drain's refusal another
# The services never end a call CANCELLED themselves and this module never cancels the calls it
# makes: a CANCELLED it sees is a stopping server's (grpc/grpc#41785), retried like UNAVAILABLE.
RETRIED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
# The fields a stream delivers piece by piece, per choice (logprobs follow token_ids).
STREAMED_FIELDS = ("text", "reasoning_text", "token_ids", "tool_calls")


class RetryDiverged(RuntimeError):
    """A retried stream's output differs from what the earlier attempt already delivered (the request
    was not reproducible: sampled without a seed, or replicas that serve different models)."""


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The ``google.rpc.RetryInfo`` delay of ``error``'s status, in seconds; ``None`` when it has none
    (a broken connection carries no details)."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # trailer and status code disagree: no usable details
        return None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def reproducible(request: prepare_pb2.GenerateRequest) -> prepare_pb2.GenerateRequest:
    """``request`` when a retry reproduces its output (greedy, or seeded); else a copy with a random
    seed in ``[0, 2**64)``, which draws from the same distribution and reproduces on a retry."""
    greedy = request.HasField("temperature") and request.temperature == 0.0
    if greedy or request.HasField("seed"):
        return request
    seeded = prepare_pb2.GenerateRequest()
    seeded.CopyFrom(request)
    seeded.seed = random.getrandbits(64)
    return seeded


class _Delivered:
    """What the caller has been handed so far, per choice and field; cuts a retried attempt's chunks
    down to what is new."""

    def __init__(self) -> None:
        self._sent: dict[tuple[int, str], Sequence] = {}
        self._finished: set[int] = set()
        self._received: dict[tuple[int, str], int] = {}  # per attempt: how much of each field it re-sent

    def new_attempt(self) -> None:
        self._received = {}

    def fresh(self, chunk: prepare_pb2.GenerateStreamResponse) -> prepare_pb2.GenerateStreamResponse | None:
        """``chunk`` less what was delivered before; ``None`` when nothing of it is new.

        Raises:
            RetryDiverged: the chunk contradicts what was delivered.
        """
        if chunk.index in self._finished:
            return None
        fresh = prepare_pb2.GenerateStreamResponse()
        fresh.CopyFrom(chunk)
        new = False
        for field in STREAMED_FIELDS:
            key = (chunk.index, field)
            got = getattr(chunk, field)
            got = got if isinstance(got, str) else list(got)
            sent = self._sent.get(key, got[:0])
            at = self._received.get(key, 0)
            overlap = max(0, min(len(got), len(sent) - at))
            if got[:overlap] != sent[at:at + overlap]:
                raise RetryDiverged(f"the retried stream's {field} of choice {chunk.index} differs from what was delivered")
            self._received[key] = at + len(got)
            rest = got[overlap:]
            self._sent[key] = sent + rest
            new = new or bool(rest)
            if isinstance(rest, str):
                setattr(fresh, field, rest)
            else:
                del getattr(fresh, field)[:overlap]
                if field == "token_ids" and len(chunk.logprobs) == len(chunk.token_ids):
                    del fresh.logprobs[:overlap]
        if chunk.finish_reason:
            self._finished.add(chunk.index)
            return fresh
        return fresh if new else None


def stream_generation(stub: prepare_pb2_grpc.GenerationStub, request: prepare_pb2.GenerateRequest,
                      timeout_s: float | None = None, metadata: list[tuple[str, str]] | None = None,
                      attempts: int = RETRY_ATTEMPTS,
                      on_retry: Callable[[grpc.RpcError, float], None] | None = None,
                      sleep: Callable[[float], None] = time.sleep) -> Iterator[prepare_pb2.GenerateStreamResponse]:
    """Yield the chunks of ``GenerateStream(request)``, retrying the call on ``UNAVAILABLE`` or ``CANCELLED``.

    Each retry waits the status's RetryInfo delay (else a jittered exponential backoff from 0.1 s)
    and is handed only what the earlier attempts had not yet delivered (module docstring). Pass a
    reproducible request (:func:`reproducible`).

    Args:
        stub: a Generation stub; its channel picks the replica (e.g. round robin over several).
        timeout_s: deadline of the whole generation, retries and their waits included, in seconds.
        attempts: calls in all (>= 1).
        on_retry: called with the error and the delay in seconds before each retry.
        sleep: waits that many seconds (tests pass a fake).

    Raises:
        grpc.RpcError: any status but :data:`RETRIED_CODES`; one of those on the last attempt, or
            when the wait would pass the deadline.
        RetryDiverged: a retry's output contradicts what was delivered.
        ValueError: ``attempts`` < 1.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    backoff = Backoff(log, "prepare")
    delivered = _Delivered()
    for attempt in range(1, attempts + 1):
        delivered.new_attempt()
        remaining_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            for chunk in stub.GenerateStream(request, timeout=remaining_s, metadata=metadata):
                fresh = delivered.fresh(chunk)
                if fresh is not None:
                    yield fresh
            return
        except grpc.RpcError as error:
            if error.code() not in RETRIED_CODES or attempt == attempts:
                raise
            delay_s = retry_delay_s(error)
            delay_s = backoff.next_delay() if delay_s is None else delay_s
            if deadline is not None and time.monotonic() + delay_s >= deadline:
                raise
            if on_retry is not None:
                on_retry(error, delay_s)
            sleep(delay_s)
