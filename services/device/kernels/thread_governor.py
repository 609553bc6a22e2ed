"""Fewer compute threads while other work holds the CPUs; all of them again once it is gone.

An OpenMP parallel region ends when its slowest thread does. A compute thread that shares its
core with another process runs half the time, and the other threads wait for it (spinning) at
every barrier of every step: measured on 2 cores with one kept busy by another process, 32 served
streams ran at 261–291 tokens/s with 2 compute threads and 582–622 with 1 (docs/benchmarks.md,
"CPU contention"). `cpu_budget` sizes the threads for the CPUs the device may use; this governor
follows the CPUs it actually gets.

Contention is read from the run-queue wait of the device's threads (``/proc/self/task/*/schedstat``,
field 2: time runnable but not running), per second of wall time and per compute thread, over
windows of ``window_s`` in which the compute thread was busy at least half the time (an idle device
says nothing). Measured per compute thread at 32 streams on 2 cores (``benchmarks/run_queue_wait.py``,
docs/benchmarks.md): 0.21–0.23 quiet (the pipeline's own other threads), 0.44–0.45 with one core
busy, 0.15–0.26 with one compute thread either way; hence ``contended_wait`` 0.33. But the wait
cannot tell another process from the pipeline's own prepare and reclaim on the same cores: at one
stream they take a larger share of each (short) step, the wait crosses the line, and one thread
runs slower than two (served ITL p50 15.8 against 13.6 ms on the 2-core Xeon with AMX, 2026-12-01: docs/benchmarks.md, "Served again"). So every
change is a **trial judged by the step rate** (steps per second over the windows):

- Two contended windows in a row at ``t > 1`` threads: try ``t - 1``.
- ``probe_after_s`` since the last change, below the budget: try ``t + 1`` (the wait at ``t``
  threads cannot show for sure that a core came free); sooner, after two windows below
  ``calm_wait`` (one thread's wait quiet 0.15, with one core busy 0.25–0.26, measured as above),
  unless a try up failed since the last one that stayed.
- With ``probe_down`` (the governor of small steps: `backends.CpuBackend`), above one thread, after
  two busy windows at the count and at least the wait a failed trial down set (none at first): try
  ``t - 1`` without contention. A step of a few rows leaves the host's own threads (prepare, reclaim,
  the device's gRPC streams) a larger share of each step than the wait shows: on the 2-core AMD EPYC,
  one stream served at 5.80 ms a token on one thread against 6.78 on two (docs/benchmarks.md, "One
  stream: the GIL"), while the Xeon with AMX measured two faster (above); the trial decides.
- A trial runs two busy windows (one, where its rate differs from before by more than
  ``clear_margin``); it stays if their step rate beat the two windows before it by ``trial_gain``
  (the small steps' trial down: if it fell by less than that: at a tie one thread fewer serves the
  same tokens with less CPU and no barrier for a preemption to stall, which is one stream's tail:
  on the AMD EPYC a trial judged 153.0 against 151.3 steps/s where one thread's ITL p99 was 10.7 ms
  and two threads' 12.9), else the count goes back and the next trial that way waits ``probe_after_s``
  since, twice that after another failure, and so on (up to ``max_probe_after_s``); a trial that
  stays resets the waits (a drop may then come as soon as contention shows).

A window's step rate counts only the time the device was stepping: a pause between two steps
longer than ``idle_gap_s`` (a request's arrival at one stream, the other governor's prefill) is left
out, since the thread count did not cause it; one such pause in a one-second window would otherwise
move its rate by more than the trial's margin.

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
        window_s, contended_wait, calm_wait, probe_after_s, max_probe_after_s, trial_gain, clear_margin:
            the rule's figures (seconds; run-queue wait in CPU-seconds per second per compute thread;
            the share a trial's step rate must gain, and the change that decides after one window).
        probe_down: also try one thread fewer without contention (module docstring).
        idle_gap_s: a pause between steps longer than this (seconds) is not counted in the step rate.
        clock, read_wait, set_threads: injectable for tests (defaults: ``time.monotonic``,
            `process_run_queue_wait_s`, ``torch.set_num_threads``).
    """

    def __init__(self, max_threads: int, window_s: float = 2.0, contended_wait: float = 0.33, calm_wait: float = 0.2, probe_after_s: float = 30.0,
                 max_probe_after_s: float = 300.0, trial_gain: float = 0.02, clear_margin: float = 0.1, probe_down: bool = False,
                 idle_gap_s: float = 0.02, clock: Callable[[], float] = time.monotonic,
                 read_wait: Callable[[], float] = process_run_queue_wait_s, set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.max_threads = self.threads = max(1, max_threads)
        self._window_s, self._contended_wait, self._calm_wait = window_s, contended_wait, calm_wait
        self._trial_gain, self._clear_margin, self._probe_down, self._idle_gap_s = trial_gain, clear_margin, probe_down, idle_gap_s
        self._max_wait_s = max_probe_after_s
        self._fresh_waits = {+1: probe_after_s, -1: 0.0}  # before a trial up / down, after the last change: a drop may come at once
        self._wait_before = dict(self._fresh_waits)
        self._clock, self._read_wait, self._set_threads = clock, read_wait, set_threads
        self._window_start, self._wait_at_start, self._busy_s, self._steps = clock(), read_wait(), 0.0, 0
        self._idle_s, self._last_end = 0.0, self._window_start  # the window's pauses longer than idle_gap_s; the last step's end
        self._last_change = self._window_start
        self._rates: list[float] = []  # step rates of the busy windows at the current count (the last two), or of the trial
        self._trial: tuple[int, float] | None = None  # (direction, the step rate before it) while a trial runs
        self._contended_streak = self._calm_streak = 0

    def run(self, step: Callable[[], T]) -> T:
        """``step()``, timed; at the end of a window, the thread count for the next steps is decided."""
        start = self._clock()
        if start - self._last_end > self._idle_gap_s:
            self._idle_s += start - max(self._last_end, self._window_start)
        try:
            return step()
        finally:
            end = self._last_end = self._clock()
            self._busy_s += end - start
            self._steps += 1
            if end - self._window_start >= self._window_s:
                self._end_window(end)

    def _end_window(self, now: float) -> None:
        elapsed = now - self._window_start
        wait = self._read_wait()
        wait_per_thread = (wait - self._wait_at_start) / elapsed / self.threads
        busy, rate = self._busy_s / elapsed, self._steps / max(elapsed - self._idle_s, self._busy_s)
        self._window_start, self._wait_at_start, self._busy_s, self._steps, self._idle_s = now, wait, 0.0, 0, 0.0
        if busy < 0.5:
            self._contended_streak = self._calm_streak = 0
            return
        self._rates = [*self._rates[-1:], rate] if self._trial is None else [*self._rates, rate]
        if self._trial is not None:
            if len(self._rates) >= 2 or abs(rate / self._trial[1] - 1) > self._clear_margin:
                self._judge_trial(now)
            return
        self._contended_streak = self._contended_streak + 1 if wait_per_thread > self._contended_wait else 0
        self._calm_streak = self._calm_streak + 1 if wait_per_thread < self._calm_wait else 0
        since = now - self._last_change
        no_failed_probe = self._wait_before[+1] == self._fresh_waits[+1]
        if self._contended_streak >= 2 and self.threads > 1 and since >= self._wait_before[-1]:
            self._start_trial(-1, now, f"run-queue wait {wait_per_thread:.2f} CPU-s/s per thread: other work may hold the CPUs")
        elif self.threads < self.max_threads and (since >= self._wait_before[+1] or (self._calm_streak >= 2 and no_failed_probe)):
            self._start_trial(+1, now, "probing whether a CPU came free")
        elif self._probe_down and self.threads > 1 and len(self._rates) >= 2 and since >= self._wait_before[-1]:
            self._start_trial(-1, now, "probing whether a thread fewer leaves the host's threads the CPU they need")

    def _start_trial(self, direction: int, now: float, why: str) -> None:
        self._trial, self._rates = (direction, sum(self._rates) / len(self._rates)), []
        self._change(self.threads + direction, now, f"trying: {why}")

    def _judge_trial(self, now: float) -> None:
        direction, before = self._trial
        after = sum(self._rates) / len(self._rates)
        self._trial = None
        gain = -self._trial_gain if direction < 0 and self._probe_down else self._trial_gain
        if after >= before * (1 + gain):
            self._wait_before = dict(self._fresh_waits)
            log.info("compute threads %d kept: %.1f steps/s against %.1f", self.threads, after, before)
            self._rates = self._rates[-2:]
            return
        self._wait_before[direction] = min(max(2 * self._wait_before[direction], self._fresh_waits[+1]), self._max_wait_s)
        self._change(self.threads - direction, now, f"back: {after:.1f} steps/s against {before:.1f}")

    def _change(self, threads: int, now: float, why: str) -> None:
        log.info("compute threads %d -> %d (%s)", self.threads, threads, why)
        self._set_threads(threads)
        self.threads, self._last_change = threads, now
        self._contended_streak = self._calm_streak = 0
        if self._trial is None:  # back from a trial: the rates at this count start afresh
            self._rates = []
