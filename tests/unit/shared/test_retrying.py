"""stageserve.retrying: a stream retried on UNAVAILABLE (or a stopping server's CANCELLED) hands on each character and token once,
waits the RetryInfo delay, and refuses a retry that contradicts what was delivered."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from stageserve.retrying import RetryDiverged, reproducible, retry_delay_s, stream_generation
from stageserve.v1 import common_pb2, prepare_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH


class FakeError(grpc.RpcError, grpc.Call):
    """A failed call as grpc raises it: code, details and trailing metadata (the rich status)."""

    def __init__(self, code: grpc.StatusCode, retry_after_s: float | None = None) -> None:
        self._code = code
        self._trailers: tuple = ()
        if retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(int(retry_after_s * 1e9))
            packed = any_pb2.Any()
            packed.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
            status = rpc_status.to_status(status_pb2.Status(code=code.value[0], message="draining", details=[packed]))
            self._trailers = status.trailing_metadata

    def code(self):
        return self._code

    def details(self):
        return "draining"

    def trailing_metadata(self):
        return self._trailers

    def initial_metadata(self): return ()
    def is_active(self): return False
    def time_remaining(self): return None
    def cancel(self): return True
    def add_callback(self, callback): return False


def chunk(text: str, tokens: list[int], finish: int = 0, index: int = 0) -> prepare_pb2.GenerateStreamResponse:
    logprobs = [common_pb2.TokenLogprob(token_id=t) for t in tokens]
    return prepare_pb2.GenerateStreamResponse(text=text, token_ids=tokens, logprobs=logprobs, finish_reason=finish, index=index)


class FakeStub:
    """GenerateStream answers each call with the next script: chunks, then an optional error."""

    def __init__(self, *scripts: tuple[list, FakeError | None]) -> None:
        self.scripts = list(scripts)
        self.requests: list[prepare_pb2.GenerateRequest] = []

    def GenerateStream(self, request, timeout=None, metadata=None):
        self.requests.append(request)
        chunks, error = self.scripts.pop(0)

        def run():
            yield from chunks
            if error is not None:
                raise error
        return run()


FULL = [chunk("Hel", [1]), chunk("lo, w", [2, 3]), chunk("orld", [4]), chunk("!", [5], LENGTH)]


def test_a_stream_broken_mid_way_is_retried_and_each_piece_delivered_once():
    broken = ([chunk("Hel", [1]), chunk("lo, w", [2, 3])], FakeError(grpc.StatusCode.UNAVAILABLE))
    # The retry chunks the same output differently: "Hello" crosses what was delivered.
    retried = ([chunk("Hello", [1, 2]), chunk(", wor", [3, 4]), chunk("ld!", [5], LENGTH)], None)
    stub, waits, retries = FakeStub(broken, retried), [], []
    out = list(stream_generation(stub, prepare_pb2.GenerateRequest(prompt="x", temperature=0.0),
                                 on_retry=lambda error, delay: retries.append(error.code()), sleep=waits.append))
    assert "".join(c.text for c in out) == "Hello, world!"
    assert [t for c in out for t in c.token_ids] == [1, 2, 3, 4, 5]
    assert [lp.token_id for c in out for lp in c.logprobs] == [1, 2, 3, 4, 5]
    assert [c.text for c in out] == ["Hel", "lo, w", "or", "ld!"]
    assert [c.finish_reason for c in out] == [0, 0, 0, LENGTH]
    assert retries == [grpc.StatusCode.UNAVAILABLE] and len(waits) == 1 and 0.05 <= waits[0] <= 0.1  # backoff's first delay


def test_the_retry_info_delay_is_honoured():
    refused = ([], FakeError(grpc.StatusCode.UNAVAILABLE, retry_after_s=0.5))
    assert retry_delay_s(refused[1]) == 0.5
    waits: list[float] = []
    out = list(stream_generation(FakeStub(refused, (FULL, None)), prepare_pb2.GenerateRequest(), sleep=waits.append))
    assert waits == [0.5] and "".join(c.text for c in out) == "Hello, world!"


def test_a_call_a_stopping_server_cancelled_is_retried():
    """gRPC core ends a call that a stopping server had not handed to a handler yet CANCELLED (grpc/grpc#41785)."""
    cancelled = ([], FakeError(grpc.StatusCode.CANCELLED))
    retries: list[grpc.StatusCode] = []
    out = list(stream_generation(FakeStub(cancelled, (FULL, None)), prepare_pb2.GenerateRequest(),
                                 on_retry=lambda error, delay: retries.append(error.code()), sleep=lambda s: None))
    assert retries == [grpc.StatusCode.CANCELLED] and "".join(c.text for c in out) == "Hello, world!"


def test_other_codes_and_the_last_attempt_raise():
    invalid = FakeError(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as raised:
        list(stream_generation(FakeStub(([], invalid)), prepare_pb2.GenerateRequest(), sleep=lambda s: None))
    assert raised.value is invalid
    lost = [([], FakeError(grpc.StatusCode.UNAVAILABLE)) for _ in range(2)]
    with pytest.raises(grpc.RpcError) as raised:
        list(stream_generation(FakeStub(*lost), prepare_pb2.GenerateRequest(), attempts=2, sleep=lambda s: None))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError, match="attempts"):
        list(stream_generation(FakeStub(), prepare_pb2.GenerateRequest(), attempts=0))


def test_a_retry_that_contradicts_the_delivered_text_raises():
    broken = ([chunk("Hel", [1])], FakeError(grpc.StatusCode.UNAVAILABLE))
    other = ([chunk("Goodbye", [7, 8], LENGTH)], None)
    with pytest.raises(RetryDiverged, match="text"):
        list(stream_generation(FakeStub(broken, other), prepare_pb2.GenerateRequest(), sleep=lambda s: None))


def test_a_finished_choice_is_not_finished_twice():
    # n = 2: choice 0 ended before the break; the retry re-sends its final chunk.
    broken = ([chunk("A", [1], LENGTH, index=0), chunk("B", [2], index=1)], FakeError(grpc.StatusCode.UNAVAILABLE))
    retried = ([chunk("A", [1], LENGTH, index=0), chunk("BC", [2, 3], LENGTH, index=1)], None)
    out = list(stream_generation(FakeStub(broken, retried), prepare_pb2.GenerateRequest(), sleep=lambda s: None))
    assert [(c.index, c.text, c.finish_reason) for c in out] == [(0, "A", LENGTH), (1, "B", 0), (1, "C", LENGTH)]


def test_only_an_unseeded_sampled_request_gets_a_seed():
    greedy = prepare_pb2.GenerateRequest(prompt="x", temperature=0.0)
    seeded = prepare_pb2.GenerateRequest(prompt="x", seed=7)
    assert reproducible(greedy) is greedy and reproducible(seeded) is seeded
    sampled = prepare_pb2.GenerateRequest(prompt="x", temperature=0.8)
    made = reproducible(sampled)
    assert made.HasField("seed") and 0 <= made.seed < 2**64 and not sampled.HasField("seed")
    assert made.prompt == "x" and made.temperature == pytest.approx(0.8)
