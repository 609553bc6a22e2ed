"""The comparison runs: each starts every side it compares, runs them alternately on the same
workload (``--repeats`` times, so a shared machine's noise hits both sides alike) and reports
medians and side-by-side ratios (the median of the per-repeat ratios).

- `compare_dispatch`: ``--dispatch async`` versus ``sync`` on the simulated device at several step
  times and on the real model; steady step period, tokens/s, and ``period / max(stage time)``.
- `compare_split`: the three services versus `InProcessPipeline` (the same code in one process).
- `compare_peers`: the three services versus transformers ``generate`` (static batches) and
  llama-cpp-python (one request at a time), plus single-stream ITL.
- `sweep`: tokens/s and p99 ITL against concurrency for stageserve and the peers, with a plot.

**Step period** of a three-service run is read from reclaim's publication times: a `StepClock`
subscribes to ``Reclaim.Subscribe`` (as any extra subscriber may) and stamps each ``StepEvents``.
In a steady pipeline every stage runs at the same period, so the period of the longest run of
consecutive steps that each carry one token for every stream is the device's step period.
**Device stage time** is the simulated step time for the sim, and for the real model the median
time of the forward pass + sampling of full decode steps, measured in-process on the same workload.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stageserve.bench.inprocess import InProcessPipeline, InProcessTransport
from stageserve.bench.llama_server import CompletionTransport, LlamaServer
from stageserve.bench.loadgen import GrpcTransport, Load, run_load
from stageserve.bench.metrics import build_report
from stageserve.bench.workload import Shape, Workload, load_prompts
from stageserve.launcher import Pipeline, start_pipeline
from stageserve.v1 import prepare_pb2


# ---- step period, from reclaim's publications ----------------------------------------------------
class StepClock:
    """Stamps every ``StepEvents`` reclaim at ``target`` publishes: ``(perf_counter s, step_id, events)``."""

    def __init__(self, target: str) -> None:
        import grpc

        from stageserve.v1 import reclaim_pb2, reclaim_pb2_grpc

        self._channel = grpc.insecure_channel(target)
        self._call = reclaim_pb2_grpc.ReclaimStub(self._channel).Subscribe(reclaim_pb2.SubscribeRequest(peer="bench-step-clock"))
        self._call.initial_metadata()  # subscribed from here on
        self.samples: list[tuple[float, int, int]] = []
        self._thread = threading.Thread(target=self._read, name="bench-step-clock", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        import grpc

        try:
            for step in self._call:
                self.samples.append((time.perf_counter(), step.step_id, len(step.events)))
        except grpc.RpcError:
            pass  # cancelled by stop()

    def stop(self) -> list[tuple[float, int, int]]:
        self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()
        return self.samples


def steady_period_ms(samples: list[tuple[float, int, int]], rows: int) -> float | None:
    """Mean gap (ms) over the longest run of consecutive step ids that each published ``rows`` events.

    The first two steps of the run are skipped (the pipeline is still filling). ``None`` when
    fewer than 8 such steps remain.
    """
    best: list[float] = []
    run: list[float] = []
    last_id = None
    for stamp, step_id, events in samples:
        if events != rows or (last_id is not None and step_id != last_id + 1):
            run = []
        if events == rows:
            run.append(stamp)
            if len(run) > len(best):
                best = run
        last_id = step_id if events == rows else None
    steady = best[2:]
    return (steady[-1] - steady[0]) / (len(steady) - 1) * 1e3 if len(steady) >= 8 else None


# ---- the sides -------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One run of one side: the load generator's report and the steady step period (ms, if measured)."""

    report: dict[str, Any]
    period_ms: float | None = None
    device_step_ms: float | None = None


class ServicesSide:
    """The three services as processes (started like ``stageserve up``), driven over gRPC; all three load ``model_path``."""

    def __init__(self, name: str, workdir: Path, model_path: Path, device_args: list[str], prepare_args: list[str] = ()) -> None:
        self.name = name
        logs = workdir / name
        logs.mkdir(parents=True, exist_ok=True)
        model = ["--model", str(model_path)]
        self.pipeline: Pipeline = start_pipeline(logs, device_args=[*model, *device_args], prepare_args=[*model, *prepare_args], reclaim_args=model, log_dir=logs)

    def run(self, workload: Workload, load: Load, progress: bool = True) -> RunResult:
        clock = StepClock(self.pipeline.reclaim.address)
        records = asyncio.run(run_load(lambda: GrpcTransport(self.pipeline.prepare.address), workload, load, progress))
        time.sleep(0.05)  # the last publications reach the clock
        samples = clock.stop()
        rows = load.streams or 0
        return RunResult(build_report(records, _config(self.name, workload, load)), steady_period_ms(samples, rows))

    def close(self) -> None:
        self.pipeline.stop()


LLAMA = "llama-server"


class LlamaServerSide:
    """A running `LlamaServer` as a comparison side (the interface of `ServicesSide`): ``--parallel
    parallel`` slots of ``tokens_per_slot`` tokens (default: ``common``'s input and output lengths),
    with ``extra_args`` (its speculative decoding, for one). Prompts must be token ids."""

    def __init__(self, binary: Path, workdir: Path, common: Common, parallel: int, name: str = LLAMA,
                 tokens_per_slot: int | None = None, extra_args: list[str] = ()) -> None:
        self.name = name
        tokens_per_slot = tokens_per_slot or common.input_len + common.output_len + 16
        log = workdir / f"{name.replace(' ', '-').replace('=', '')}.log"
        self.server = LlamaServer(binary, common.model_path, parallel, tokens_per_slot, log, extra_args=extra_args)

    def run(self, workload: Workload, load: Load, progress: bool = True) -> RunResult:
        records = asyncio.run(run_load(lambda: CompletionTransport(self.server.port), workload, load, progress))
        return RunResult(build_report(records, _config(self.name, workload, load)))

    def close(self) -> None:
        self.server.stop()


class InProcessSide:
    """The same code in this process without gRPC (`InProcessPipeline`)."""

    def __init__(self, name: str, model_path: Path, device_args: list[str]) -> None:
        self.name = name
        self.pipeline = InProcessPipeline(model_path, device_args)

    def run(self, workload: Workload, load: Load, progress: bool = True) -> RunResult:
        mark = self.pipeline.steps_run()
        records = self.pipeline.serve_while(lambda: asyncio.run(run_load(lambda: InProcessTransport(self.pipeline), workload, load, progress)))
        step_ms = self.pipeline.device_step_ms(load.streams or 1, since=mark)
        return RunResult(build_report(records, _config(self.name, workload, load)), None, step_ms)

    def close(self) -> None:
        self.pipeline.close()


def _config(side: str, workload: Workload, load: Load) -> dict[str, Any]:
    shape = workload.shape
    return {"side": side, "streams": load.streams, "rate": load.rate, "requests": load.requests, "duration_s": load.duration_s,
            "output_len": shape.output_len, "input_len": shape.input_len, "spread": shape.spread, "seed": workload.seed}


def local_tokenize(model_path: Path) -> Callable[[prepare_pb2.GenerateRequest], list[int]]:
    """Token ids of a request's input as prepare computes them, with the model's tokenizer in this process."""
    from stageserve.prepare.validation import tokenize_prompt
    from stageserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    return lambda request: tokenize_prompt(tokenizer, prompt=request.prompt, messages=request.messages, prompt_token_ids=request.prompt_token_ids)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _alternate(sides: list, workload: Workload, load: Load, repeats: int, warmup: Load | None = None, progress: bool = True) -> dict[str, list[RunResult]]:
    """Run every side ``repeats`` times, side after side in each round; one warm-up run each first."""
    if warmup is not None:
        for side in sides:
            side.run(workload, warmup, progress=False)
    results: dict[str, list[RunResult]] = {side.name: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            results[side.name].append(side.run(workload, load, progress))
    return results


@dataclass(frozen=True)
class Common:
    """Flags every comparison shares."""

    model_path: Path
    dtype: str
    backend: str
    repeats: int
    output_len: int
    input_len: int
    seed: int
    out_dir: Path
    progress: bool = True  # progress bars on stderr while a side runs

    def model_device_args(self) -> list[str]:
        """``stageserve device`` flags for the real model."""
        return ["--backend", self.backend, "--dtype", self.dtype]


def _workload(common: Common, tokenize) -> Workload:
    return Workload(load_prompts(), Shape(output_len=common.output_len, input_len=common.input_len), common.seed, tokenize)


def _save(common: Common, name: str, data: dict[str, Any]) -> Path:
    common.out_dir.mkdir(parents=True, exist_ok=True)
    path = common.out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=_jsonable))
    return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, RunResult):
        return value.__dict__
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


# ---- async versus sync dispatch ----------------------------------------------------------------------
def compare_dispatch(common: Common, sim_step_ms: list[float], streams: int, include_model: bool) -> str:
    """Async versus sync dispatch (see the module docstring); returns the Markdown table.

    Raises:
        ValueError: no simulated step time and no model: nothing to compare.
    """
    tokenize = local_tokenize(common.model_path)
    workload = _workload(common, tokenize)
    load = Load(streams=streams, requests=streams)
    warmup = Load(streams=min(streams, 4), requests=min(streams, 4))
    cases = [(f"sim {ms:g} ms", ["--backend", "sim", "--sim-step-ms", str(ms)], ms) for ms in sim_step_ms]
    if include_model:
        cases.append((f"{common.backend} model {common.dtype}", common.model_device_args(), None))
    if not cases:
        raise ValueError("nothing to compare: give --sim-step-ms values or leave out --no-model")
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        for label, device_args, stage_ms in cases:
            sides = []
            try:
                for mode in ("async", "sync"):
                    sides.append(ServicesSide(mode, Path(tmp) / label.replace(" ", "_"), common.model_path, [*device_args, "--dispatch", mode]))
                results = _alternate(sides, workload, load, common.repeats, warmup, common.progress)
            finally:
                for side in sides:
                    side.close()
            if stage_ms is None:  # the real model: its device stage, measured in-process on the same workload
                inprocess = InProcessSide("inprocess", common.model_path, [*device_args, "--dispatch", "async"])
                try:
                    stage_ms = _median([r.device_step_ms for r in _alternate([inprocess], workload, load, common.repeats, warmup, common.progress)["inprocess"]])
                finally:
                    inprocess.close()
            raw[label] = {"results": results, "max_stage_ms": stage_ms}
            period = {mode: _median([r.period_ms for r in results[mode]]) for mode in results}
            tps = {mode: _median([r.report["output_tokens_per_s"] for r in results[mode]]) for mode in results}
            sync_over_async = _median([_ratio(s.period_ms, a.period_ms) for a, s in zip(results["async"], results["sync"])])
            tps_ratio = _median([_ratio(a.report["output_tokens_per_s"], s.report["output_tokens_per_s"]) for a, s in zip(results["async"], results["sync"])])
            rows.append(f"| {label} | {_fmt(stage_ms, 2)} | {_fmt(period['async'], 2)} | {_fmt(period['sync'], 2)} | {_fmt(_ratio(period['async'], period['sync']), 2)} "
                        f"| {_fmt(sync_over_async, 2)}x | {_fmt(tps['async'])} | {_fmt(tps['sync'])} | {_fmt(tps_ratio, 2)}x "
                        f"| {_fmt(_ratio(period['async'], stage_ms), 2)} | {_fmt(_ratio(period['sync'], stage_ms), 2)} |")
            print(rows[-1], flush=True)
    _save(common, "compare-dispatch", raw)
    header = (f"{streams} streams x {common.output_len} output tokens (input {common.input_len} tokens, greedy, ignore_eos), median of {common.repeats}\n\n"
              "| device | max stage (ms) | async period (ms) | sync period (ms) | async/sync period | sync/async (paired) | async tok/s | sync tok/s | async/sync tok/s | async period / max stage | sync period / max stage |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return "\n".join([header, *rows])


# ---- three services versus one process -------------------------------------------------------------
def compare_split(common: Common, streams: list[int]) -> str:
    """The three services versus the in-process baseline at each stream count; returns the Markdown table."""
    tokenize = local_tokenize(common.model_path)
    workload = _workload(common, tokenize)
    device_args = common.model_device_args()
    rows, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        services = inprocess = None
        try:
            services = ServicesSide("services", Path(tmp), common.model_path, device_args)
            inprocess = InProcessSide("inprocess", common.model_path, device_args)
            for count in streams:
                load = Load(streams=count, requests=max(count, 3))
                results = _alternate([services, inprocess], workload, load, common.repeats, Load(streams=count, requests=count) if count == streams[0] else None, common.progress)
                raw[count] = results
                for name in ("services", "inprocess"):
                    reports = [r.report for r in results[name]]
                    rows.append(f"| {count} | {name} | {_fmt(_median([r['ttft_ms']['p50'] for r in reports]))} | {_fmt(_median([r['itl_ms']['p50'] for r in reports]))} "
                                f"| {_fmt(_median([r['itl_ms']['p99'] for r in reports]))} | {_fmt(_median([r['output_tokens_per_s'] for r in reports]))} | |")
                ratio = _median([_ratio(s.report["output_tokens_per_s"], i.report["output_tokens_per_s"]) for s, i in zip(results["services"], results["inprocess"])])
                rows.append(f"| {count} | **services / in-process** | | | | {_fmt(ratio, 3)}x | {_fmt(None if ratio is None else (1 - ratio) * 100, 1, ' %')} |")
                print("\n".join(rows[-3:]), flush=True)
        finally:
            for side in (services, inprocess):
                if side is not None:
                    side.close()
    _save(common, "compare-split", raw)
    header = (f"{common.dtype}, {common.output_len} output tokens (input {common.input_len} tokens, greedy, ignore_eos); requests = max(streams, 3); median of {common.repeats}\n\n"
              "| streams | side | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | output tok/s | tokens/s lost to the split |\n"
              "|---:|---|---:|---:|---:|---:|---:|")
    return "\n".join([header, *rows])


# ---- peers -------------------------------------------------------------------------------------------
def _peer_prompts(workload: Workload, count: int) -> list[list[int]]:
    return [list(workload.request(i).prompt_token_ids) for i in range(count)]


def run_peer(name: str, common: Common, workload: Workload, concurrency: int, requests: int) -> dict[str, Any] | None:
    """One peer's report at ``concurrency`` (batch size, or queued requests for llama-cpp); ``None`` if not installed."""
    from stageserve.bench import peers

    prompts = _peer_prompts(workload, requests)
    if name == "llama-cpp-python" and common.model_path.suffix != ".gguf":
        print(f"{name}: skipped, it reads GGUF files only ({common.model_path})", flush=True)
        return None
    try:
        if name == "transformers":
            records = peers.transformers_static_batches(common.model_path, common.dtype, prompts, common.output_len, concurrency, common.backend)
        else:
            records = peers.llama_cpp_serial(common.model_path, prompts, common.output_len)
    except ImportError as exc:
        print(f"{name}: not installed ({exc}); pip install 'stageserve[bench]'", flush=True)
        return None
    return build_report(records, {"side": name, "streams": concurrency, "requests": requests, "output_len": common.output_len, "input_len": common.input_len})


def compare_peers(common: Common, streams: int) -> str:
    """stageserve (three services) versus transformers and llama-cpp-python at ``streams`` and at 1; Markdown table."""
    workload = _workload(common, local_tokenize(common.model_path))
    raw: dict[str, dict[str, list]] = {}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        services = ServicesSide("stageserve", Path(tmp), common.model_path, common.model_device_args())
        try:
            for count in (streams, 1):
                results = _alternate([services], workload, Load(streams=count, requests=count), common.repeats, Load(streams=count, requests=count), common.progress)
                raw.setdefault("stageserve", {})[count] = [r.report for r in results["stageserve"]]
        finally:
            services.close()
    for peer in ("transformers", "llama-cpp-python"):
        for count in (streams, 1):
            reports = [run_peer(peer, common, workload, count, count) for _ in range(common.repeats)]
            raw.setdefault(peer, {})[count] = [r for r in reports if r is not None]
    _save(common, "compare-peers", raw)
    ours = _median([r["output_tokens_per_s"] for r in raw["stageserve"][streams]])
    lines = [f"{common.dtype} (llama-cpp-python: the GGUF's own Q4_1), input {common.input_len} tokens, {common.output_len} output tokens, greedy, median of {common.repeats}\n",
             f"| system | {streams} streams: output tok/s | stageserve / system | {streams} streams: ITL p50 (ms) | 1 stream: ITL p50 (ms) | 1 stream: ITL p99 (ms) | 1 stream: tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("stageserve", "stageserve (3 services)"), ("transformers", f"transformers generate, static batch of {streams}"),
                        ("llama-cpp-python", "llama-cpp-python, one request at a time")):
        many, one = raw[name].get(streams, []), raw[name].get(1, [])
        tps = _median([r["output_tokens_per_s"] for r in many])
        lines.append(f"| {label} | {_fmt(tps)} | {_fmt(_ratio(ours, tps), 2)}x | {_fmt(_median([r['itl_ms']['p50'] for r in many]))} "
                     f"| {_fmt(_median([r['itl_ms']['p50'] for r in one]))} | {_fmt(_median([r['itl_ms']['p99'] for r in one]))} | {_fmt(_median([r['output_tokens_per_s'] for r in one]))} |")
    return "\n".join(lines)


# ---- concurrency sweep and plot -------------------------------------------------------------------------
def sweep(common: Common, concurrency: list[int], llama_max_requests: int, plot_path: Path) -> str:
    """tokens/s and p99 ITL against concurrency for stageserve and the peers; writes the PNG; returns a Markdown table."""
    from stageserve.bench.plot import plot_sweep

    workload = _workload(common, local_tokenize(common.model_path))
    series: dict[str, dict[int, dict[str, Any]]] = {"stageserve": {}, "transformers": {}, "llama-cpp-python": {}}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        services = ServicesSide("stageserve", Path(tmp), common.model_path, common.model_device_args())
        try:
            services.run(workload, Load(streams=4, requests=4), progress=False)
            for count in concurrency:
                series["stageserve"][count] = services.run(workload, Load(streams=count, requests=count), common.progress).report
        finally:
            services.close()
    for count in concurrency:
        for peer, requests in (("transformers", count), ("llama-cpp-python", min(count, llama_max_requests))):
            report = run_peer(peer, common, workload, count, requests)
            if report is not None:
                series[peer][count] = report
    _save(common, "sweep", series)
    plot_sweep(series, plot_path, f"{common.model_path.name}, {common.dtype}, {common.output_len} output tokens")
    lines = ["| concurrency | " + " | ".join(f"{name} tok/s | {name} ITL p99 (ms)" for name in series) + " |",
             "|---:|" + "---:|---:|" * len(series)]
    for count in concurrency:
        cells = []
        for name in series:
            report = series[name].get(count)
            cells += [_fmt(report and report["output_tokens_per_s"]), _fmt(report and report["itl_ms"]["p99"])]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
