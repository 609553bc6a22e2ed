"""The signal behind the device's adaptive compute threads (services/device/kernels/thread_governor.py):
the run-queue wait of the device's threads, quiet and with one core kept busy by another process,
at 32 served streams, with the tokens/s of each run.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/run_queue_wait.py --threads 2
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/run_queue_wait.py --threads 1

The device runs with ``--no-adaptive-threads`` (the count given stays). For each case ("quiet",
"busy", twice, alternating) a load runs on a thread; after 3 s of it, the device's CPU time and
run-queue wait (``/proc/PID/task/*/schedstat``, summed over its threads) and the idle time of the
machine's CPUs (``/proc/stat``) are read over 5 s, in CPU-seconds per second.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from contention import BUSY, bench

from stageserve.launcher import start_pipeline


def thread_seconds(pid: int) -> tuple[float, float]:
    """(CPU seconds, run-queue wait seconds) of process ``pid``, summed over its threads."""
    run = wait = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as stats:
                ran, waited, _ = stats.read().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        run, wait = run + int(ran), wait + int(waited)
    return run / 1e9, wait / 1e9


def idle_seconds() -> float:
    """Idle plus iowait seconds of all CPUs since boot (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="the device's --threads (default %(default)s)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="run-queue-wait-"))
    pipeline = start_pipeline(workdir, log_dir=workdir, device_args=["--threads", str(args.threads), "--no-adaptive-threads"])
    try:
        for condition in ("quiet", "busy", "quiet", "busy"):
            busy = subprocess.Popen(BUSY) if condition == "busy" else None
            result: dict = {}
            load = threading.Thread(target=lambda: result.update(bench(pipeline.prepare.address, 32, 96, 64)))
            load.start()
            time.sleep(3)
            (run0, wait0), idle0, start = thread_seconds(pipeline.device.pid), idle_seconds(), time.monotonic()
            time.sleep(5)
            (run1, wait1), idle1, elapsed = thread_seconds(pipeline.device.pid), idle_seconds(), time.monotonic() - start
            load.join()
            if busy is not None:
                busy.kill()
                busy.wait()
            print(f"--threads {args.threads} {condition:5}: device runs {(run1 - run0) / elapsed:.2f} CPUs, run-queue wait "
                  f"{(wait1 - wait0) / elapsed:.2f} CPU-s/s ({(wait1 - wait0) / elapsed / args.threads:.2f} per compute thread), "
                  f"machine idle {(idle1 - idle0) / elapsed:.2f} CPUs; {result['tokens_per_s']:.0f} tokens/s", flush=True)
    finally:
        pipeline.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
