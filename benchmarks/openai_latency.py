"""Latency of a forced tool call on the embedded model against an unconstrained completion of the
same length, and of embeddings, through the OpenAI API with the official SDK, alternately on one
pipeline (so a shared machine's noise hits all alike).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/openai_latency.py --rounds 7

Each round: a chat request whose ``tool_choice`` names a function (its arguments constrained by the
function's schema; non-streamed, greedy), then the same messages unconstrained with ``max_tokens``
set to the call's completion tokens and ``ignore_eos`` (exactly as many tokens), then an
embedding of the user message alone, the same text as a completion of one token (what the
embedding's prefill costs as a generation), and 16 sentences embedded in one request. Prints the
p50 of each, in milliseconds, and the tool call's ratio to the unconstrained completion.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import openai

from stageserve.launcher import start_pipeline

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "unit", "days"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_forecast", "description": "The weather forecast of a city", "parameters": SCHEMA}}
MESSAGES = [{"role": "user", "content": "What will the weather be in Paris over the next three days?"}]
SENTENCES = [f"Sentence number {i} is about the weather in city {i}." for i in range(16)]


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    reply = call()
    return (time.perf_counter() - start) * 1000.0, reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        pipeline = start_pipeline(Path(workdir), prepare_args=["--http-port", "0"], log_dir=Path(workdir))
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{pipeline.prepare.http_port}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            forced = dict(model=model, messages=MESSAGES, tools=[TOOL], temperature=0, max_tokens=64,
                          tool_choice={"type": "function", "function": {"name": "get_forecast"}})
            timed(lambda: client.chat.completions.create(**forced))  # warm-up: the schema's grammar compiles once
            calls, plain, one, prefill, many, tokens = [], [], [], [], [], 0
            for _ in range(args.rounds):
                ms, reply = timed(lambda: client.chat.completions.create(**forced))
                calls.append(ms)
                tokens = reply.usage.completion_tokens
                ms, _ = timed(lambda: client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=tokens,
                                                                     extra_body={"ignore_eos": True}))
                plain.append(ms)
                one.append(timed(lambda: client.embeddings.create(model=model, input=MESSAGES[0]["content"]))[0])
                prefill.append(timed(lambda: client.completions.create(model=model, prompt=MESSAGES[0]["content"], max_tokens=1))[0])
                many.append(timed(lambda: client.embeddings.create(model=model, input=SENTENCES))[0])
            call_p50, plain_p50 = statistics.median(calls), statistics.median(plain)
            print(f"forced tool call ({tokens} tokens): p50 {call_p50:.0f} ms over {args.rounds} (min {min(calls):.0f}, max {max(calls):.0f})")
            print(f"unconstrained, same length:      p50 {plain_p50:.0f} ms (min {min(plain):.0f}, max {max(plain):.0f})")
            print(f"ratio: {call_p50 / plain_p50:.2f}")
            print(f"embedding, 1 input:   p50 {statistics.median(one):.0f} ms (min {min(one):.0f}, max {max(one):.0f})")
            print(f"completion of 1 token, same text: p50 {statistics.median(prefill):.0f} ms (min {min(prefill):.0f}, max {max(prefill):.0f})")
            print(f"embedding, 16 inputs: p50 {statistics.median(many):.0f} ms (min {min(many):.0f}, max {max(many):.0f})")
        finally:
            pipeline.stop()


if __name__ == "__main__":
    main()
