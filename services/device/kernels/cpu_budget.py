"""How many CPUs the device may really use.

The host's core count is the wrong default for the compute threads: a container sees every core
of its node but may run only on those of its CPU affinity (``sched_getaffinity``: cpusets,
``taskset``, Kubernetes' static CPU manager) and only for its CFS quota's share of time (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``: a pod's CPU limit). With more OpenMP
threads than that, a forward pass ends each parallel region waiting for a thread that is not
running, every region of every step.

:func:`default_compute_threads` is that budget less what the device's own other threads use
(gRPC server, completion thread, ``SIDE_THREADS_CPUS``: ~5 % of a core measured for gRPC, see
docs/benchmarks.md; rounded so that a CPU that is mostly free still gets a thread).

Within this budget, `stageserve.device.kernels.thread_governor` follows the CPUs the device actually gets.

torch's OpenMP barrier spin (libgomp's ``GOMP_SPINCOUNT``) is left at the runtime's default: a
shorter spin measured slower on a quiet machine (docs/benchmarks.md), and its gain under contention
is not measured yet. An operator can still set it in the device's environment.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SIDE_THREADS_CPUS = 0.25
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = _CGROUP_ROOT) -> float | None:
    """The CFS quota in CPUs (``cpu.max`` ``"150000 100000"`` = 1.5), or ``None`` without a limit.

    Reads cgroup v2 (``root/cpu.max``) or v1 (``root/cpu/cpu.cfs_quota_us`` and ``cpu.cfs_period_us``)
    of the process's own namespace root, where a container's limit shows."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = _CGROUP_ROOT) -> float:
    """CPUs this process may use: its affinity's size, capped by the cgroup quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    return float(affinity) if quota is None else min(float(affinity), quota)


def default_compute_threads(cpus: float | None = None) -> int:
    """torch intra-op threads for ``cpus`` usable CPUs (default: :func:`usable_cpus`): one per CPU
    of which at least half is left after the side threads, at least one.

    2 CPUs -> 2, 1.5 (a quota) -> 1, 8 -> 8, 0.5 -> 1."""
    cpus = usable_cpus() if cpus is None else cpus
    return max(1, math.floor(cpus - SIDE_THREADS_CPUS + 0.5))
