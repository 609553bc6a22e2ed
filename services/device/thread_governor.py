"""Fewer compute threads while other work holds the CPUs; all of them again once it is gone.

An OpenMP parallel region ends when its slowest thread does. A compute thread that shares its
core with another process runs half the time, and the other threads wait for it (spinning) at
every barrier of every step: measured on 2 cores with one kept busy by another process, 32 served
streams ran at 261–291 tokens/s with 2 compute threads and 582–622 with 1 (docs/benchmarks.md,
"CPU contention"). `cpu_budget` sizes the threads for the CPUs the device may use; this governor
follows the CPUs it actually gets.

The signal is the run-queue wait of the device's threads (``/proc/self/task/*/schedstat``, field
2: time runnable but not running), per second of wall time and per compute thread, over windows
of ``window_s`` in which the compute thread was busy at least half the time (an idle device says
nothing). Measured per compute thread at 32 streams on 2 cores (``benchmarks/run_queue_wait.py``,
docs/benchmarks.md): 0.21–0.23 quiet (the pipeline's own other threads), 0.44–0.45 with one core
busy, 0.15–0.26 with one compute thread either way; hence ``contended_wait`` 0.33.

- Two contended windows in a row at ``t > 1`` threads: ``t - 1``.
- Below the budget, no contention, ``probe_after_s`` since the last change: ``t + 1`` (a probe; the
  wait at ``t`` threads cannot show that a core came free). Two contended windows during the
  probe: back to ``t - 1`` and the next probe waits twice as long (up to ``max_probe_after_s``);
  two calm ones: the probe stays and the wait is reset.

Every change is logged; `threads` is what the next step uses.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def process_run_queue_wait_s() -> float:
    """Seconds this process's threads have spent runnable but not running (sum over threads, since each started).

    Raises:
        OSError: ``/proc`` is not readable (not Linux).
    """
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stats:
                total += int(stats.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total / 1e9


class ComputeThreadGovernor:
    """Adapts torch's intra-op threads between 1 and ``max_threads`` to the CPUs the device gets (module docstring).

    Call `run` with each step on the compute thread: ``torch.set_num_threads`` sets that thread's
    OpenMP team size, so the change must happen there, between steps.

    Args:
        max_threads: the thread budget (``--threads``), at least 1.
        window_s, contended_wait, probe_after_s, max_probe_after_s: the rule's figures (seconds; run-queue
            wait in CPU-seconds per second per compute thread).
        clock, read_wait, set_threads: injectable for tests (defaults: ``time.monotonic``,
            `process_run_queue_wait_s`, ``torch.set_num_threads``).
    """

    def __init__(self, max_threads: int, window_s: float = 2.0, contended_wait: float = 0.33, probe_after_s: float = 30.0,
                 max_probe_after_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 read_wait: Callable[[], float] = process_run_queue_wait_s, set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads = self.threads = max(1, max_threads)
        self._window_s, self._contended_wait = window_s, contended_wait
        self._base_probe_after_s = self._probe_after_s = probe_after_s
        self._max_probe_after_s = max_probe_after_s
        self._clock, self._read_wait, self._set_threads = clock, read_wait, set_threads
        self._window_start, self._wait_at_start, self._busy_s = clock(), read_wait(), 0.0
        self._last_change = self._window_start
        self._probing = False
        self._contended_streak = self._calm_streak = 0

    def run(self, step: Callable[[], T]) -> T:
        """``step()``, timed; at the end of a window, the thread count for the next steps is decided."""
        start = self._clock()
        try:
            return step()
        finally:
            end = self._clock()
            self._busy_s += end - start
            if end - self._window_start >= self._window_s:
                self._end_window(end)

    def _end_window(self, now: float) -> None:
        elapsed = now - self._window_start
        wait = self._read_wait()
        wait_per_thread = (wait - self._wait_at_start) / elapsed / self.threads
        busy = self._busy_s / elapsed
        self._window_start, self._wait_at_start, self._busy_s = now, wait, 0.0
        if busy < 0.5:
            self._contended_streak = self._calm_streak = 0
            return
        if wait_per_thread > self._contended_wait:
            self._contended_streak, self._calm_streak = self._contended_streak + 1, 0
        else:
            self._contended_streak, self._calm_streak = 0, self._calm_streak + 1
        if self._contended_streak >= 2 and self.threads > 1:
            if self._probing:
                self._probe_after_s = min(2 * self._probe_after_s, self._max_probe_after_s)
            self._change(self.threads - 1, now, f"run-queue wait {wait_per_thread:.2f} CPU-s/s per thread: other work holds the CPUs")
        elif self._probing and self._calm_streak >= 2:
            self._probing, self._probe_after_s = False, self._base_probe_after_s
        elif not self._probing and self._calm_streak and self.threads < self.max_threads and now - self._last_change >= self._probe_after_s:
            self._change(self.threads + 1, now, "probing whether a CPU came free")
            self._probing = True

    def _change(self, threads: int, now: float, why: str) -> None:
        log.info("compute threads %d -> %d (%s)", self.threads, threads, why)
        self._set_threads(threads)
        self.threads, self._last_change = threads, now
        self._probing, self._contended_streak, self._calm_streak = False, 0, 0
