"""``stageserve bench compare-structured``: every request constrained by a JSON schema against the
same prompts unconstrained, alternately on one running pipeline (so a shared machine's noise hits
both alike): output tokens/s and its ratio, the steady step period of each, and the device's time
to compile a new schema and to find a cached one (``stageserve_grammar_compile_seconds``).

The default schema (`BENCH_SCHEMA`) is a mid-sized object (nested object, enum, bounded integers,
a string pattern, an array of objects) repeated in an array with ``minItems`` far above what
``--output-len`` tokens can hold, so a constrained request runs its ``max_tokens`` like an
unconstrained one with ``ignore_eos``: both sides generate exactly the same number of tokens.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from stageserve.bench.compare import Common, ServicesSide, _fmt, _median, _ratio, _save, local_tokenize
from stageserve.bench.loadgen import Load
from stageserve.bench.workload import Shape, Workload, load_prompts
from stageserve.v1 import common_pb2

RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "maxLength": 24},
        "status": {"enum": ["active", "suspended", "closed"]},
        "email": {"type": "string", "pattern": "^[a-z]{2,10}@[a-z]{2,10}\\.(com|org)$"},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "orders": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["sku", "qty"]}},
    },
    "required": ["id", "name", "status", "email", "address", "orders"],
}
BENCH_SCHEMA = {"type": "array", "items": RECORD, "minItems": 1000}


def compare_structured(common: Common, streams: int, schema: dict | None = None) -> str:
    """Constrained against unconstrained runs (see the module docstring); returns the Markdown table."""
    schema = schema or BENCH_SCHEMA
    constraint = common_pb2.Constraint(json_schema=json.dumps(schema))
    tokenize = local_tokenize(common.model_path)
    shapes = {"unconstrained": Shape(common.output_len, common.input_len, temperature=1.0),
              "constrained": Shape(common.output_len, common.input_len, ignore_eos=False, temperature=1.0, constraint=constraint)}
    workloads = {name: Workload(load_prompts(), shape, common.seed, tokenize) for name, shape in shapes.items()}
    load = Load(streams=streams, requests=streams)
    results: dict[str, list] = {name: [] for name in workloads}
    with tempfile.TemporaryDirectory(prefix="stageserve-bench-") as tmp:
        side = ServicesSide("services", Path(tmp), common.model_path, common.model_device_args())
        try:
            compile_new = _compile_seconds(side, lambda: side.run(workloads["constrained"], Load(streams=1, requests=1), progress=False))
            compile_cached = _compile_seconds(side, lambda: side.run(workloads["constrained"], Load(streams=1, requests=1), progress=False), cached=True)
            side.run(workloads["unconstrained"], Load(streams=min(streams, 4), requests=min(streams, 4)), progress=False)
            for _ in range(common.repeats):
                for name, workload in workloads.items():
                    results[name].append(side.run(workload, load, common.progress))
        finally:
            side.close()
    _save(common, "compare-structured", {"schema": schema, "results": results, "compile_new_s": compile_new, "compile_cached_s": compile_cached})
    tps = {name: _median([r.report["output_tokens_per_s"] for r in runs]) for name, runs in results.items()}
    period = {name: _median([r.period_ms for r in runs]) for name, runs in results.items()}
    ratio = _median([_ratio(c.report["output_tokens_per_s"], u.report["output_tokens_per_s"]) for c, u in zip(results["constrained"], results["unconstrained"])])
    return (f"{streams} streams x {common.output_len} output tokens (input {common.input_len} tokens, temperature 1), {common.dtype} on {common.backend}, "
            f"median of {common.repeats}; the constrained side's schema: {len(json.dumps(schema))} characters\n\n"
            "| side | output tok/s | step period (ms) |\n|---|---:|---:|\n"
            f"| unconstrained | {_fmt(tps['unconstrained'])} | {_fmt(period['unconstrained'], 2)} |\n"
            f"| constrained | {_fmt(tps['constrained'])} | {_fmt(period['constrained'], 2)} |\n"
            f"| **constrained / unconstrained** | {_fmt(ratio, 3)}x | {_fmt(_ratio(period['constrained'], period['unconstrained']), 3)}x |\n\n"
            f"Compile on the device: a new schema {_fmt(None if compile_new is None else compile_new * 1e3, 2, ' ms')}, "
            f"a cached one {_fmt(None if compile_cached is None else compile_cached * 1e3, 4, ' ms')} (cache lookup).")


def _compile_seconds(side: ServicesSide, run, cached: bool = False) -> float | None:
    """Seconds the device's ``stageserve_grammar_compile_seconds{cached}`` grew by over ``run()``, per observation."""
    before = _compile_histogram(side, cached)
    run()
    after = _compile_histogram(side, cached)
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


def _compile_histogram(side: ServicesSide, cached: bool) -> tuple[float, float]:
    """(sum, count) of the device's compile histogram for ``cached``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    port = side.pipeline.device.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    label = str(cached).lower()
    values = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "stageserve_grammar_compile_seconds":
            for sample in family.samples:
                kind = sample.name.rsplit("_", 1)[-1]
                if sample.labels.get("cached") == label and kind in values:
                    values[kind] += sample.value
    return values["sum"], values["count"]
