"""Issue 35, item 1: where one stream's inter-token latency goes, served through the three services.

Starts the three services (``--device-args`` as given), runs one greedy stream of ``--output-len``
tokens ``--requests`` times with ``stageserve bench`` (a process of its own: the client), and reads
every thread's CPU time (``utime + stime`` of ``/proc/PID/task/TID/stat``) of each process before and
after. Prints the ITL p50/p99 and the CPU time per output token of each process, broken down by thread
name (the device's main thread runs the steps; ``OMP`` workers are torch's second compute thread),
so the host's work per token is seen beside the step's. For the device's compute thread (its main
thread: ``docs/benchmarks.md``, "The compute thread") it also gives, per output token, the time it
ran, waited runnable for a CPU and was blocked (from ``/proc/PID/task/PID/schedstat`` and the wall
time), and its voluntary context switches (``status``): a compute thread that blocks many times a
step is waiting for the GIL, which the device's other Python threads take each time they wake.
``--repeats`` runs, medians. ``--streams N`` runs N streams at once instead (figures still per
output token: times N for a step's).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/one_stream_profile.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from stageserve.launcher import start_pipeline

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each live thread of ``pid``, summed by thread name (digits folded: ``OMP#``)."""
    totals: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"\d+", "#", stat[stat.index("(") + 1 : stat.rindex(")")])
        fields = stat[stat.rindex(")") + 2 :].split()
        totals[name] += (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return totals


def compute_thread_sched(pid: int) -> dict[str, float]:
    """The main thread of ``pid``: seconds run and waited on a run queue (``schedstat`` fields 1, 2),
    and its voluntary context switches (``status``)."""
    run_ns, wait_ns, _ = map(int, Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split())
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    voluntary = int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M).group(1))
    return {"run": run_ns / 1e9, "wait": wait_ns / 1e9, "switches": voluntary}


def difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``after - before`` per name (a thread that started meanwhile counts from zero)."""
    return {name: seconds - before.get(name, 0.0) for name, seconds in after.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams (default 1)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--device-args", default="", help="extra flags for the device, one string")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="one-stream-"))
    pipeline = start_pipeline(workdir, device_args=args.device_args.split(), prepare_args=["--http-port", "off"], log_dir=workdir)
    services = {"device": pipeline.device.pid, "reclaim": pipeline.reclaim.pid, "prepare": pipeline.prepare.pid}
    runs: list[dict] = []
    try:
        for repeat in range(-1, args.repeats):  # the first run warms up and is not counted
            before = {name: thread_cpu_s(pid) for name, pid in services.items()}
            compute_before, start = compute_thread_sched(pipeline.device.pid), time.monotonic()
            report_path = workdir / f"report-{repeat}.json"
            client = subprocess.run(["/usr/bin/time", "-f", "%U %S", sys.executable, "-m", "stageserve", "bench", "--target",
                                     pipeline.prepare.address, "--streams", str(args.streams), "--requests", str(args.requests),
                                     "--output-len", str(args.output_len), "--input-len", str(args.input_len), "--no-progress",
                                     "--json", str(report_path)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall_s, compute = time.monotonic() - start, difference(compute_thread_sched(pipeline.device.pid), compute_before)
            after = {name: thread_cpu_s(pid) for name, pid in services.items()}
            if repeat < 0:
                continue
            report = json.loads(report_path.read_text())
            tokens = report["output_tokens"]
            user, system = map(float, client.stderr.strip().splitlines()[-1].split())
            run = {"itl_p50_ms": report["itl_ms"]["p50"], "itl_p99_ms": report["itl_ms"]["p99"],
                   "client_ms_per_token": (user + system) / tokens * 1e3}
            for name in services:
                for thread, seconds in difference(after[name], before[name]).items():
                    run[f"{name}/{thread}"] = seconds / tokens * 1e3
            run["compute thread: ran, ms"] = compute["run"] / tokens * 1e3
            run["compute thread: waited for a CPU, ms"] = compute["wait"] / tokens * 1e3
            run["compute thread: blocked, ms"] = (wall_s - compute["run"] - compute["wait"]) / tokens * 1e3
            run["compute thread: voluntary switches"] = compute["switches"] / tokens
            runs.append(run)
            print(f"run {repeat + 1}: ITL p50 {run['itl_p50_ms']:.2f} ms, p99 {run['itl_p99_ms']:.2f} ms", flush=True)
    finally:
        pipeline.stop()
    keys = sorted({key for run in runs for key in run})
    medians = {key: statistics.median(run.get(key, 0.0) for run in runs) for key in keys}
    print(f"\nmedians of {len(runs)} runs, {args.streams} stream(s), {args.requests} requests x {args.output_len} tokens; per output token"
          " (CPU ms of each process's threads by name; the device's compute thread: wall ms and switches):")
    print("| figure | value |\n|---|---:|")
    for key in keys:
        if medians[key] >= 0.005:
            print(f"| {key} | {medians[key]:.2f} |")
    for name in services:
        total = sum(value for key, value in medians.items() if key.startswith(f"{name}/"))
        print(f"| **{name} total** | {total:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
