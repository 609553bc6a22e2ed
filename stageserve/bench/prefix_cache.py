"""Prefix caching on against off (``prepare --no-prefix-caching``): three workloads, both sides
started once and run alternately (``--repeats`` rounds), figures the medians.

- **shared system prompt**: every request is one long system prompt (``system_tokens`` tokens)
  plus a short question of its own, at 1 stream and at ``streams`` streams; TTFT p50 and output
  tokens/s.
- **multi-turn chat**: a conversation of ``turns`` turns, each resending the whole conversation so
  far (the previous turns' prompts and replies as token ids, then a new question); TTFT per turn,
  also against llama.cpp's ``llama-server`` (prompt cache on) when one is given.
- **no shared prefix**: prompts of random token ids (no block in common), new ones for every run
  of every side (a repeated prompt would hit); output tokens/s, the cost of hashing and looking up
  blocks that never hit.

Prompts are token ids, so lengths are exact and a resent conversation is a true prefix.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from stageserve.bench.compare import LLAMA, Common, ServicesSide, _fmt, _median, _ratio, _save
from stageserve.bench.llama_server import CompletionTransport, LlamaServer
from stageserve.bench.loadgen import GrpcTransport, Load, Transport, close_transport
from stageserve.bench.workload import Shape, Workload
from stageserve.v1 import prepare_pb2

SIDES = ("on", "off")
CHAT_SYSTEM_TOKENS, CHAT_QUESTION_TOKENS = 200, 40


def _random_ids(rng: random.Random, count: int, vocab: int = 40000) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(count)]


def _shared_prefix_prompts(system_tokens: int, question_tokens: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    system = _random_ids(rng, system_tokens)
    return [{"prompt_token_ids": system + _random_ids(rng, question_tokens)} for _ in range(count)]


def _distinct_prompts(prompt_tokens: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    return [{"prompt_token_ids": _random_ids(rng, prompt_tokens)} for _ in range(count)]


async def _chat(make_transport: Callable[[], Transport], turns: int, output_len: int, seed: int) -> list[float]:
    """One conversation, turn after turn; the TTFT (ms) of each turn."""
    rng = random.Random(seed)
    transport = make_transport()
    history, ttfts = _random_ids(rng, CHAT_SYSTEM_TOKENS), []
    try:
        for turn in range(turns):
            history += _random_ids(rng, CHAT_QUESTION_TOKENS)
            request = prepare_pb2.GenerateRequest(request_id=f"chat-{seed}-{turn}", prompt_token_ids=history, max_tokens=output_len,
                                                  ignore_eos=True, temperature=0.0)
            sent, first, reply = time.perf_counter(), None, []
            async for arrival, chunk in transport.stream(request):
                if chunk.token_ids and first is None:
                    first = arrival
                reply += chunk.token_ids
            ttfts.append((first - sent) * 1e3)
            history += reply
    finally:
        await close_transport(transport)
    return ttfts


def compare_prefix_cache(common: Common, streams: int, system_tokens: int = 1500, turns: int = 8, llama_server: Path | None = None) -> str:
    """Prefix caching on against off on the three workloads (module docstring), the chat also against ``llama_server``
    (the program; ``None``: without it); returns Markdown."""
    output_len, repeats = common.output_len, common.repeats
    shape = Shape(output_len=output_len)
    shared = Workload(_shared_prefix_prompts(system_tokens, 24, 64, common.seed), shape, common.seed)
    loads = {"1 stream": Load(streams=1, requests=6), f"{streams} streams": Load(streams=streams, requests=2 * streams)}
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        sides, llama = [], None
        try:
            if llama_server is not None:  # --parallel 4: the conversation's slot is found by prompt similarity, as in real use
                chat_tokens = CHAT_SYSTEM_TOKENS + turns * (CHAT_QUESTION_TOKENS + output_len) + 16
                llama = LlamaServer(llama_server, common.model_path, 4, chat_tokens, Path(tmp) / "llama-server.log")
            for name in SIDES:
                prepare_args = [] if name == "on" else ["--no-prefix-caching"]
                sides.append(ServicesSide(name, Path(tmp), common.model_path, common.model_device_args(), prepare_args))
            for side in sides:  # warm-up: the first prefill of a shape builds the kernels' plans
                side.run(shared, Load(streams=2, requests=2), progress=False)
            results: dict[str, dict[str, list]] = {}
            for round_ in range(repeats):
                for label, load in [*[(f"shared prompt, {k}", v) for k, v in loads.items()], (f"no shared prefix, {streams} streams", None)]:
                    for k, side in enumerate(sides if round_ % 2 == 0 else sides[::-1]):  # no side always first
                        if load is None:  # fresh prompts: a prompt another run sent would hit
                            seed = common.seed + 100 * round_ + k
                            workload, load_now = Workload(_distinct_prompts(common.input_len, 2 * streams, seed), shape, seed), Load(streams=streams, requests=2 * streams)
                        else:
                            workload, load_now = shared, load
                        results.setdefault(label, {}).setdefault(side.name, []).append(side.run(workload, load_now, progress=False).report)
                chat_sides = {side.name: (lambda side=side: GrpcTransport(side.pipeline.prepare.address)) for side in sides}
                if llama is not None:
                    chat_sides[LLAMA] = lambda: CompletionTransport(llama.port, cache_prompt=True)
                for name, make_transport in chat_sides.items():  # every side gets the same conversation in a round
                    ttfts = asyncio.run(_chat(make_transport, turns, output_len, common.seed + round_))
                    results.setdefault("chat", {}).setdefault(name, []).append(ttfts)
            raw = results
        finally:
            for side in sides:
                side.close()
            if llama is not None:
                llama.stop()
    _save(common, "compare-prefix-cache", raw)
    return _tables(raw, common, turns)


def _tables(raw: dict[str, Any], common: Common, turns: int) -> str:
    """The Markdown of one comparison's results (medians over rounds; ratios the median of per-round ratios)."""
    lines = [f"{common.dtype}, {common.output_len} output tokens per request (greedy, ignore_eos), median of {common.repeats} interleaved rounds\n"]
    lines.append("| workload | TTFT p50 on (ms) | TTFT p50 off (ms) | off/on TTFT | tok/s on | tok/s off | on/off tok/s |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for label, by_side in raw.items():
        if label == "chat":
            continue
        on, off = by_side["on"], by_side["off"]
        ttft = [_median([r["ttft_ms"]["p50"] for r in reports]) for reports in (on, off)]
        tps = [_median([r["output_tokens_per_s"] for r in reports]) for reports in (on, off)]
        ttft_ratio = _median([_ratio(b["ttft_ms"]["p50"], a["ttft_ms"]["p50"]) for a, b in zip(on, off)])
        tps_ratio = _median([_ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]) for a, b in zip(on, off)])
        lines.append(f"| {label} | {_fmt(ttft[0])} | {_fmt(ttft[1])} | {_fmt(ttft_ratio, 2)}x | {_fmt(tps[0])} | {_fmt(tps[1])} | {_fmt(tps_ratio, 3)}x |")
    lines.append(f"\nmulti-turn chat ({turns} turns, {CHAT_SYSTEM_TOKENS}-token system prompt, {CHAT_QUESTION_TOKENS}-token questions, "
                 "each turn resends the conversation): TTFT (ms) per turn\n")
    lines.append("| turn | " + " | ".join(str(t + 1) for t in range(turns)) + " |")
    lines.append("|---|" + "---:|" * turns)
    for name, runs in raw["chat"].items():
        lines.append(f"| {name} | " + " | ".join(_fmt(_median([run[t] for run in runs])) for t in range(turns)) + " |")
    return "\n".join(lines)
