"""`compare_weights`: the three services with quantized weights against the same with bfloat16 weights
against llama.cpp's ``llama-server`` (``--parallel N``), same GGUF, same prompt token ids.

All three servers are up together and run alternately (``--repeats``), at 1 stream and at N; the
table gives medians of ITL p50/p99 and output tokens/s, the per-repeat ratios against llama-server,
and each side's resident memory after the runs (the three services' ``VmRSS`` summed; llama-server's);
a second table gives each process's resident and proportional (``Pss``: a shared page counted as its
share, so the figures add up across processes) memory at rest, before the first request, and after.
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from stageserve.bench.compare import LLAMA, Common, LlamaServerSide, RunResult, ServicesSide, _alternate, _fmt, _median, _ratio, _save, _workload, local_tokenize
from stageserve.bench.loadgen import Load
from stageserve.process_memory import proportional_bytes, resident_bytes


def compare_weights(common: Common, llama_server: Path | None, streams: int, weights: list[str]) -> str:
    """stageserve with each of ``weights`` against llama-server (``None``: without it) at 1 and ``streams`` streams;
    Markdown table. Each of ``weights`` is a ``--weights`` value, optionally followed by more device
    flags for that side (``"auto --dense-copy all"``)."""
    workload = _workload(common, local_tokenize(common.model_path))
    results: dict[int, dict[str, list[RunResult]]] = {}
    memory: dict[str, dict[str, dict[str, tuple[int, int]]]] = {}  # side -> moment -> process -> (RSS, PSS)
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        sides: list = []
        try:
            for index, side_flags in enumerate(weights):
                fmt, *extra = shlex.split(side_flags)
                sides.append(ServicesSide(f"stageserve {side_flags}", Path(tmp) / str(index), common.model_path,
                                          [*common.model_device_args(), "--weights", fmt, *extra]))
            if llama_server is not None:
                sides.append(LlamaServerSide(llama_server, Path(tmp), common, streams))
            for side in sides:
                memory[side.name] = {"at rest": _memory(side)}
            for count in (1, streams):
                load = Load(streams=count, requests=max(count, 4))
                results[count] = _alternate(sides, workload, load, common.repeats, Load(streams=count, requests=count), common.progress)
            for side in sides:
                memory[side.name]["after"] = _memory(side)
        finally:
            for side in sides:
                side.close()
    _save(common, "compare-weights", {"results": results, "resident_bytes": memory})
    lines = [f"{common.dtype} activations, input {common.input_len} tokens, {common.output_len} output tokens, greedy, ignore_eos; "
             f"requests = max(streams, 4); median of {common.repeats} (ratios: median of the per-repeat ratios)\n",
             f"| system | 1 stream: ITL p50 (ms) | ITL p99 (ms) | tok/s | ITL p50 / llama-server | {streams} streams: ITL p50 (ms) | ITL p99 (ms) "
             f"| tok/s | tok/s / llama-server | resident MiB after |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in results[1]:
        cells = []
        for count in (1, streams):
            mine, theirs = results[count][name], results[count].get(LLAMA, [])
            reports = [r.report for r in mine]
            cells += [_fmt(_median([r["itl_ms"]["p50"] for r in reports]), 2), _fmt(_median([r["itl_ms"]["p99"] for r in reports]), 2),
                      _fmt(_median([r["output_tokens_per_s"] for r in reports]))]
            key = ("itl_ms", "p50") if count == 1 else ("output_tokens_per_s", None)
            cells.append(_fmt(_median([_ratio(_pick(a.report, key), _pick(b.report, key)) for a, b in zip(mine, theirs)]), 2) + "x")
        after = memory.get(name, {}).get("after", {})
        resident = after.get("stack", after.get(LLAMA, (0, 0)))[0]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {resident / 2**20:.0f} |")
    lines += ["", "| system | process | at rest: resident MiB | proportional MiB | after: resident MiB | proportional MiB |",
              "|---|---|---:|---:|---:|---:|"]
    for name, moments in memory.items():
        for process in moments["at rest"]:
            figures = [value / 2**20 for moment in ("at rest", "after") for value in moments.get(moment, {}).get(process, (0, 0))]
            lines.append(f"| {name} | {process} | " + " | ".join(f"{value:.0f}" for value in figures) + " |")
    return "\n".join(lines)


def _memory(side) -> dict[str, tuple[int, int]]:
    """(resident, proportional) bytes of each process of ``side``: the three services, or llama-server;
    for the services, their sum as ``stack``."""
    if isinstance(side, LlamaServerSide):
        pids = {"llama-server": side.server.pid}
    else:
        pids = {process.role: process.pid for process in side.pipeline.processes}
    figures = {name: (resident_bytes(pid), proportional_bytes(pid)) for name, pid in pids.items()}
    if len(figures) > 1:
        figures["stack"] = tuple(sum(values) for values in zip(*figures.values()))
    return figures


def _pick(report: dict, key: tuple[str, str | None]) -> float | None:
    value = report[key[0]]
    return value if key[1] is None else value[key[1]]
