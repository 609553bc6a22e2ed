"""Issue 34: a well-behaved key's time to first token against 0, 1 and 4 abusive keys.

One pipeline on loopback (the embedded model, float32) with five API keys: ``good`` and
``abuse-1`` .. ``abuse-4``, each abuser limited in the keys file (``max_running=4 max_waiting=4``).
While k abusers run (k = 0, 1, 4), each keeps sending, over and over: 8 long greedy streams
(``max_tokens`` 160), a distinct slow JSON schema (1,000 optional properties: ~2.5 s to compile,
past the device's 1 s budget here) and 4 concurrent 256 KiB Tokenize calls. Meanwhile ``good``
sends 12 short streamed requests one after another; printed: their TTFT median and p90, and what
the abusers' requests ended with.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/tenant_ttft.py
"""

from __future__ import annotations

import collections
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from stageserve.launcher import start_pipeline
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

DEVICE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--grammar-compile-budget", "1", "--metrics-port", "0"]
ABUSERS, PROBES = 4, 12


def key_of(name: str) -> str:
    return f"key-of-{name}-0123456789"


def metadata(name: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key_of(name)}")]


def first_token_ms(stub, name: str) -> float:
    start = time.monotonic()
    stream = stub.GenerateStream(prepare_pb2.GenerateRequest(prompt="Say hello.", max_tokens=2, temperature=0.0, ignore_eos=True),
                                 metadata=metadata(name), timeout=300)
    next(chunk for chunk in stream if chunk.token_ids)
    stream.cancel()
    return (time.monotonic() - start) * 1e3


def abuse(stub, name: str, stop: threading.Event, outcomes: collections.Counter, text: str) -> None:
    """Long streams, a slow schema and big Tokenize calls of ``name``, again and again until ``stop``."""
    rng = random.Random(name)

    def call(kind: str, fn) -> None:
        try:
            fn()
            outcomes[f"{kind} OK"] += 1
        except grpc.RpcError as error:
            outcomes[f"{kind} {error.code().name}"] += 1

    while not stop.is_set():
        schema = json.dumps({"type": "object", "properties": {f"p{rng.randrange(1 << 30)}_{i}": {"type": "integer"} for i in range(1000)}})
        work = [lambda: call("stream", lambda: list(stub.GenerateStream(prepare_pb2.GenerateRequest(
                    prompt="Write a long story.", max_tokens=160, temperature=0.0, ignore_eos=True), metadata=metadata(name), timeout=300)))
                for _ in range(8)]
        work.append(lambda: call("schema", lambda: stub.Generate(prepare_pb2.GenerateRequest(
            prompt="Fill the form:", max_tokens=8, constraint={"json_schema": schema}), metadata=metadata(name), timeout=300)))
        work += [lambda: call("tokenize", lambda: stub.Tokenize(prepare_pb2.TokenizeRequest(prompt=text), metadata=metadata(name), timeout=300))
                 for _ in range(4)]
        threads = [threading.Thread(target=w) for w in work]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def main() -> None:
    rng = random.Random(7)
    words = ["".join(rng.choice("abcdefghij klmnop") for _ in range(7)) for _ in range(2000)]
    text = " ".join(rng.choice(words) for _ in range(40_000))[: 1 << 18]
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys"
        names = ["good"] + [f"abuse-{i}" for i in range(1, ABUSERS + 1)]
        keys.write_text("".join(f"{key_of(n)} {n}{'' if n == 'good' else ' max_running=4 max_waiting=4'}\n" for n in names))
        pipeline = start_pipeline(Path(folder), device_args=DEVICE_ARGS, prepare_args=["--api-keys-file", str(keys)], log_dir=Path(folder))
        try:
            with grpc.insecure_channel(pipeline.prepare.address) as channel:
                stub = prepare_pb2_grpc.GenerationStub(channel)
                first_token_ms(stub, "good")  # warm
                for active in (0, 1, ABUSERS):
                    stop, outcomes = threading.Event(), collections.Counter()
                    abusers = [threading.Thread(target=abuse, args=(stub, f"abuse-{i}", stop, outcomes, text)) for i in range(1, active + 1)]
                    for thread in abusers:
                        thread.start()
                    time.sleep(3 if active else 0)
                    ttft = sorted(first_token_ms(stub, "good") for _ in range(PROBES))
                    stop.set()
                    for thread in abusers:
                        thread.join()
                    print(f"{active} abusive keys: good key's TTFT median {statistics.median(ttft):.0f} ms,"
                          f" p90 {ttft[int(0.9 * (len(ttft) - 1))]:.0f} ms; abusers' requests: {dict(sorted(outcomes.items()))}", flush=True)
        finally:
            pipeline.stop()


if __name__ == "__main__":
    main()
