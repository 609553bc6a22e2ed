"""`compare_speculative`: n-gram speculative decoding (``--num-speculative-tokens`` K for each K
given), and with ``--draft-model`` draft-model speculative decoding at each K too, against none,
on two workloads, all sides up together and run alternately (``--repeats``); with
``--llama-server``, llama.cpp's server on the same GGUF without and with its own prompt lookup
(``--spec-type ngram-simple``, the same lookup and draft lengths) as well. Every side reads the
same prompt token ids (the chat template applied in the benchmark). Each round runs every side
once, starting one side later than the round before.

- **input-grounded**: each request asks the model to repeat a given passage (n-gram lookup finds
  the continuation in the prompt), greedy, ending at EOS or ``output_len``;
- **open-ended**: the built-in prompts, ``output_len`` tokens each (``ignore_eos``).

Per side, workload and stream count: output tokens/s, ITL p50 (a step emitting several tokens
counts its gap once per token, as the load generator does), and the acceptance rate, read from the
device's ``stageserve_spec_*`` counters around each run (accepted / drafted, overall and per draft
position; llama-server's is not read). Ratios are the medians of the per-round ratios against no
speculation on the same server.
"""

from __future__ import annotations

import tempfile
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

from stageserve.bench.compare import LLAMA, Common, LlamaServerSide, ServicesSide, _fmt, _median, _ratio, _save, local_tokenize
from stageserve.bench.loadgen import Load
from stageserve.bench.workload import Shape, Workload, base_request, load_prompts

OFF = "off"
PASSAGES = (
    "The river rose slowly through the night, and by morning the lower fields were under water. Farmers moved their animals to the hill, "
    "where the old church stood, and waited for the rain to stop.",
    "To reset the device, hold the power button for ten seconds until the light blinks twice, then release it and wait for the light to turn green. "
    "If the light stays red, unplug the device and try again.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes place in the chloroplasts of plant cells, "
    "which hold the green pigment chlorophyll that absorbs the light.",
    "The meeting is moved to Thursday at three in the afternoon, in room 204 on the second floor. Please bring the quarterly report "
    "and the list of open questions from last week.",
)


def grounded_prompts() -> list[dict]:
    """Chat prompts asking to repeat each passage exactly."""
    return [{"messages": [{"role": "user", "content": f"Repeat the following passage exactly, word for word:\n\n{passage}"}]} for passage in PASSAGES]


def spec_counters(metrics_port: int | None) -> dict[str, float]:
    """The device's ``stageserve_spec_*`` samples now (name, with position label, -> value)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not metrics_port:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("stageserve_spec_") and sample.name.endswith("_total"):
                counters[sample.name + sample.labels.get("position", "")] = sample.value
    return counters


def _acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Accepted / drafted between two `spec_counters` readings: overall (``all``) and per position."""
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    rates = {"all": _ratio(delta.get("stageserve_spec_accepted_tokens_total"), delta.get("stageserve_spec_draft_tokens_total"))}
    for name, drafted in delta.items():
        if name.startswith("stageserve_spec_position_drafted_total"):
            position = name.removeprefix("stageserve_spec_position_drafted_total")
            rates[position] = _ratio(delta.get(f"stageserve_spec_position_accepted_total{position}"), drafted)
    return rates


def speculative_sides(num_tokens: list[int], draft_model: Path | None, policies: list[str]) -> list[tuple[str, list[str]]]:
    """(side name, ``stageserve device`` flags) of each speculating side: ``ngram`` at each K, then,
    with ``draft_model``, ``draft`` at each K; each with every ``--speculative-policy`` of
    ``policies`` (named in the side when there are several)."""
    methods = [("ngram", [])] + ([("draft", ["--draft-model", str(draft_model)])] if draft_model else [])
    return [(f"{method} K={k}" + f" {policy}" * (len(policies) > 1),
             ["--speculative-method", method, *extra, "--num-speculative-tokens", str(k), "--speculative-policy", policy])
            for method, extra in methods for k in num_tokens for policy in policies]


def llama_server_sides(binary: Path, workdir: Path, common: Common, parallel: int, num_tokens: list[int],
                       tokens_per_slot: int) -> list[LlamaServerSide]:
    """llama-server without speculation and with its prompt lookup (``--spec-type ngram-simple``) at
    each K: a lookup of 3 tokens (as ``ngram``'s longest), drafts of K tokens at most."""
    sides = [LlamaServerSide(binary, workdir, common, parallel, LLAMA, tokens_per_slot)]
    for k in num_tokens:
        flags = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(k), "--spec-draft-n-max", str(k)]
        sides.append(LlamaServerSide(binary, workdir, common, parallel, f"{LLAMA} ngram-simple K={k}", tokens_per_slot, flags))
    return sides


def compare_speculative(common: Common, streams: list[int], num_tokens: list[int], draft_model: Path | None = None,
                        llama_server: Path | None = None, policies: list[str] = ("goodput",), weights: str = "auto") -> str:
    """No speculation against ``ngram`` (and, with ``draft_model``, ``draft``) with each K in
    ``num_tokens`` and each ``--speculative-policy`` in ``policies``, at each stream count, on both
    workloads (module docstring), every stageserve side with ``--weights weights``, and with
    ``llama_server`` that server without and with its own prompt lookup; returns Markdown."""
    tokenize = local_tokenize(common.model_path)
    # Prompts as token ids (the chat template applied here): every side, llama-server's too, reads the same tokens.
    prompts = {name: [{"prompt_token_ids": tokenize(base_request(entry))} for entry in entries]
               for name, entries in (("input-grounded", grounded_prompts()), ("open-ended", load_prompts()))}
    workloads = {
        "input-grounded": Workload(prompts["input-grounded"], Shape(output_len=common.output_len, ignore_eos=False), common.seed, tokenize),
        "open-ended": Workload(prompts["open-ended"], Shape(output_len=common.output_len), common.seed, tokenize),
    }
    tokens_per_slot = max(len(entry["prompt_token_ids"]) for entries in prompts.values() for entry in entries) + common.output_len + 16
    raw: dict[str, Any] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        sides: list[ServicesSide | LlamaServerSide] = []
        try:
            device_args = [*common.model_device_args(), "--weights", weights]
            sides.append(ServicesSide(OFF, Path(tmp), common.model_path, device_args))
            for name, flags in speculative_sides(num_tokens, draft_model, list(policies)):
                sides.append(ServicesSide(name, Path(tmp), common.model_path, [*device_args, *flags]))
            if llama_server is not None:
                sides += llama_server_sides(llama_server, Path(tmp), common, max(streams), num_tokens, tokens_per_slot)
            for side in sides:  # warm-up: the first steps of a shape build the kernels' plans
                side.run(workloads["open-ended"], Load(streams=2, requests=2), progress=False)
            for repeat in range(common.repeats):
                for label, workload in workloads.items():
                    for count in streams:
                        # Each round starts at the next side: a drift of the machine's speed within a
                        # round does not always favour the same side.
                        for side in sides[repeat % len(sides):] + sides[: repeat % len(sides)]:
                            metrics_port = side.pipeline.device.metrics_port if isinstance(side, ServicesSide) else None
                            before = spec_counters(metrics_port)
                            report = side.run(workload, Load(streams=count, requests=max(2 * count, 4)), common.progress).report
                            report["acceptance"] = _acceptance(before, spec_counters(metrics_port))
                            raw[f"{label}, {count} stream{'s' * (count > 1)}"][side.name].append(report)
        finally:
            for side in sides:
                side.close()
    _save(common, "compare-speculative", raw)
    return _table(raw, common, weights, [side_name for side_name in next(iter(raw.values()))])


def _table(raw: dict[str, Any], common: Common, weights: str, names: list[str]) -> str:
    lines = [f"{common.dtype}, --weights {weights}, greedy, {common.output_len} output tokens at most per request, median of {common.repeats} interleaved rounds\n",
             "| workload | side | tok/s | x off | ITL p50 (ms) | acceptance | per position |", "|---|---|---:|---:|---:|---:|---|"]
    for label, by_side in raw.items():
        for name in names:
            reports = by_side[name]
            tps = _median([r["output_tokens_per_s"] for r in reports])
            baseline = by_side[LLAMA if name.startswith(LLAMA) else OFF]  # llama-server's sides against its own, without speculation
            ratio = _median([_ratio(r["output_tokens_per_s"], base["output_tokens_per_s"]) for r, base in zip(reports, baseline)])
            itl = _median([r["itl_ms"]["p50"] for r in reports])
            accept = _median([r["acceptance"]["all"] for r in reports])
            positions = sorted({p for r in reports for p in r["acceptance"] if p != "all"}, key=int)
            per_position = " ".join(_fmt(_median([r["acceptance"].get(p) for r in reports]), 2) for p in positions)
            lines.append(f"| {label} | {name} | {_fmt(tps)} | {_fmt(ratio, 2)}x | {_fmt(itl)} | {_fmt(accept, 2)} | {per_position or '-'} |")
    return "\n".join(lines)
