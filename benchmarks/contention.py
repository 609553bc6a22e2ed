"""Issue 20, item 7: 32 served streams with one core kept busy by another process, before and after
the device's thread defaults (kernels/cpu_budget.py), side by side with the quiet run.

Both pipelines stay up for the whole run; the four cases (before/after x quiet/busy) are run
interleaved, ``--repeats`` times, so that load from elsewhere on a shared machine spreads over all
of them; the medians and their ratios are printed (and ``--json`` written).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/contention.py --repeats 3

"before": ``--threads`` the host's cores, fixed (``--no-adaptive-threads``), and libgomp's default
barrier spin (``GOMP_SPINCOUNT=300000``); "after": the defaults of ``stageserve device`` now
(threads from ``kernels/cpu_budget.py``, adapted to the CPUs it gets by ``kernels/thread_governor.py``). "busy": a
``while True: pass`` process runs during the measurement (stopped by pid after it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stageserve.launcher import start_pipeline

BUSY = [sys.executable, "-c", "while True: pass"]


def bench(target: str, streams: int, requests: int, output_len: int) -> dict:
    """One ``stageserve bench`` run against prepare at ``target``: output tokens/s and ITL p50/p99 (ms)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "stageserve", "bench", "--target", target, "--streams", str(streams),
                        "--requests", str(requests), "--output-len", str(output_len), "--no-progress", "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        report = json.loads(Path(out.name).read_text())
    return {"tokens_per_s": report["output_tokens_per_s"], "itl_p50_ms": report["itl_ms"]["p50"], "itl_p99_ms": report["itl_ms"]["p99"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="contention-"))
    pipelines = {}
    for name in ("before", "after"):
        (workdir / name).mkdir()
    try:
        os.environ["GOMP_SPINCOUNT"] = "300000"  # libgomp's default, as before
        pipelines["before"] = start_pipeline(workdir / "before", device_args=["--threads", str(os.cpu_count()), "--no-adaptive-threads"],
                                             log_dir=workdir / "before")
        del os.environ["GOMP_SPINCOUNT"]
        pipelines["after"] = start_pipeline(workdir / "after", log_dir=workdir / "after")
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for name, pipeline in pipelines.items():
                for condition in ("quiet", "busy"):
                    busy = subprocess.Popen(BUSY) if condition == "busy" else None
                    try:
                        result = bench(pipeline.prepare.address, args.streams, args.requests, args.output_len)
                    finally:
                        if busy is not None:
                            busy.kill()
                            busy.wait()
                    runs.setdefault(f"{name} {condition}", []).append(result)
                    print(f"{name:6} {condition:5} {result}", flush=True)
    finally:
        for pipeline in pipelines.values():
            pipeline.stop()
    medians = {case: {key: statistics.median(r[key] for r in results) for key in results[0]} for case, results in runs.items()}
    for case, median in medians.items():
        quiet = medians[case.split()[0] + " quiet"]["tokens_per_s"]
        print(f"{case:13} tokens/s {median['tokens_per_s']:7.1f} ({median['tokens_per_s'] / quiet:.2f}x its quiet run)"
              f"  ITL p50 {median['itl_p50_ms']:6.1f} ms  p99 {median['itl_p99_ms']:6.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
