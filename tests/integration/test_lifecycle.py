"""Dispatch modes and shutdown: sync dispatch gives the same text as async; SIGTERM drains."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stageserve.v1 import common_pb2, prepare_pb2_grpc

from .conftest import launch
from .test_generation_api import chat, collect

REQUESTS = [chat("What is the capital of France?", temperature=0.0, max_tokens=32),
            chat("Write a haiku about the sea.", temperature=0.0, max_tokens=32)]


def test_sync_dispatch_matches_async(generation, tmp_path_factory):
    """--dispatch sync returns the same greedy text as --dispatch async; then SIGTERM during a
    running stream lets it complete, refuses new requests with UNAVAILABLE, and every service exits 0."""
    expected = [collect(generation.GenerateStream(r))[0] for r in REQUESTS]
    sync = launch(tmp_path_factory, "pipeline-sync", device_args=["--dispatch", "sync"], prepare_args=["--drain-timeout", "60"])
    try:
        with grpc.insecure_channel(sync.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            assert [collect(stub.GenerateStream(r))[0] for r in REQUESTS] == expected

            long_request = chat("Count from one to fifty.", temperature=0.0, max_tokens=120, ignore_eos=True)
            stream = stub.GenerateStream(long_request)
            first = next(stream)
            result: dict = {}
            reader = threading.Thread(target=lambda: result.update(chunks=[first, *stream]))
            reader.start()
            sync.prepare.process.send_signal(15)  # SIGTERM
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(chat("Hello", max_tokens=4), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            reader.join(120)
            chunks = result["chunks"]
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert sum(len(c.token_ids) for c in chunks) == 120
            assert sync.prepare.process.wait(60) == 0
    finally:
        codes = sync.stop()
    assert codes == {"prepare": 0, "reclaim": 0, "device": 0}
    # The drained device ended reclaim's stream itself; its server's stop grace did not have to cancel it.
    assert "stream lost (the device closed the stream)" in sync.reclaim.log_path.read_text()
