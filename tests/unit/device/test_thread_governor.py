"""The compute-thread governor's rule, on a scripted clock and run-queue wait (the real signal is
the kernel's schedstat; what the rule does with it is what is tested here), and its signal read
from this process."""

from __future__ import annotations

import pytest

from stageserve.device.kernels.thread_governor import ComputeThreadGovernor, process_run_queue_wait_s


class Machine:
    """A scripted clock whose steps take, and whose run-queue wait grows by, what ``load`` gives for the
    governor's thread count: ``{threads: (step seconds, wait per second per thread)}`` (shaped like the
    figures measured on 2 cores, see thread_governor.py)."""

    QUIET = {1: (0.08, 0.17), 2: (0.05, 0.2)}
    ONE_CORE_BUSY = {1: (0.085, 0.24), 2: (0.16, 0.42)}  # two threads run at half the rate of one
    OWN_PIPELINE = {1: (0.016, 0.3), 2: (0.0136, 0.4)}  # one stream: prepare and reclaim raise the wait, two threads still win
    HOST_NEEDS_A_CORE = {1: (0.0058, 0.08), 2: (0.0068, 0.22)}  # one stream, 2-core AMD EPYC: one thread wins, the wait calm
    ONE_STREAM_TIE = {1: (0.0066, 0.08), 2: (0.0065, 0.22)}  # one stream, the mean rate alike (the tail is one thread's)

    def __init__(self, probe_down: bool = False, **rule) -> None:
        self.now, self.wait, self.load, self.set_calls = 0.0, 0.0, self.QUIET, []
        self.governor = ComputeThreadGovernor(2, probe_down=probe_down, clock=lambda: self.now, read_wait=lambda: self.wait,
                                              set_threads=self.set_calls.append, **rule)

    def steps(self, seconds: float, idle_s: float = 0.0) -> None:
        """Steps (with ``idle_s`` between them) for ``seconds``."""
        end = self.now + seconds
        while self.now < end:
            self.governor.run(self._step)
            self.now += idle_s

    def _step(self) -> None:
        step_s, wait = self.load[self.governor.threads]
        self.now += step_s
        self.wait += wait * self.governor.threads * step_s


def test_a_quiet_machine_keeps_every_thread() -> None:
    machine = Machine()
    machine.steps(120)
    assert machine.governor.threads == 2
    assert machine.set_calls == []


def test_contention_drops_a_thread_that_then_runs_faster_and_calm_brings_it_back() -> None:
    machine = Machine()
    machine.load = Machine.ONE_CORE_BUSY
    machine.steps(3.9)
    assert machine.governor.threads == 2  # one contended window is not enough
    machine.steps(0.4)
    assert machine.set_calls == [1]
    machine.steps(5)  # the trial's two windows: one thread ran faster, it stays
    assert machine.set_calls == [1]
    machine.load = Machine.QUIET  # the other process ended: two calm windows probe at once, not 30 s after the change
    machine.steps(7)
    assert machine.set_calls == [1, 2]
    machine.steps(60)
    assert machine.governor.threads == 2 and machine.set_calls == [1, 2]


def test_a_failed_probe_goes_back_and_the_next_waits_twice_as_long() -> None:
    machine = Machine()
    machine.load = Machine.ONE_CORE_BUSY
    machine.steps(4.5)
    machine.steps(31)  # the probe, at 30 s after the change (one thread's wait is not calm while the core is busy)
    assert machine.set_calls == [1, 2]
    machine.steps(4.5)  # two threads ran at about half the rate: back to 1 after one window
    assert machine.set_calls == [1, 2, 1]
    machine.steps(55)
    assert machine.set_calls == [1, 2, 1]  # the next probe waits 60 s
    machine.steps(8)
    assert machine.set_calls == [1, 2, 1, 2, 1]


@pytest.mark.parametrize(("probe_down", "load"), [(False, Machine.OWN_PIPELINE), (True, None)], ids=["contended", "small-steps-calm"])
def test_a_thread_fewer_that_runs_slower_comes_back_and_is_tried_again_later(probe_down, load) -> None:
    """One stream, the pipeline's own threads raising the wait over the line with no other process
    (or, for the small steps' governor, ``probe_down``, a calm machine): each trial measures one
    thread slower and goes back to two; the next comes 30 s later, the one after 60 s later."""
    machine = Machine(probe_down=probe_down)
    if load is not None:
        machine.load = load
    machine.steps(4.5)
    assert machine.set_calls == [1]
    machine.steps(4.5)
    assert machine.set_calls == [1, 2]
    machine.steps(25)
    assert machine.set_calls == [1, 2]
    machine.steps(10)
    assert machine.set_calls == [1, 2, 1, 2]
    machine.steps(50)
    assert machine.set_calls == [1, 2, 1, 2]
    machine.steps(20)
    assert machine.set_calls == [1, 2, 1, 2, 1, 2] and machine.governor.threads == 2


def test_an_idle_device_decides_nothing() -> None:
    machine = Machine()
    machine.load = {2: (0.01, 5.0)}  # huge, but the device computes a tenth of the time
    machine.steps(60, idle_s=0.09)
    assert machine.set_calls == []


def test_the_run_queue_wait_of_this_process_is_read_and_grows() -> None:
    first = process_run_queue_wait_s()
    assert first >= 0.0
    assert process_run_queue_wait_s() >= first


def test_small_steps_probe_a_thread_fewer_and_keep_it_where_it_serves_faster() -> None:
    """The small steps' governor (``probe_down``): on a calm machine where one thread serves a stream
    faster, it tries one after two busy windows and keeps it; a probe back up fails and the next
    one waits 30 s."""
    machine = Machine(probe_down=True)
    machine.load = Machine.HOST_NEEDS_A_CORE
    machine.steps(4.1)
    assert machine.set_calls == [1]
    machine.steps(4.1)  # the trial: one thread ran faster, it stays
    assert machine.set_calls == [1]
    machine.steps(8.2)  # two calm windows probe up at once; two threads run slower: back
    assert machine.set_calls == [1, 2, 1]
    machine.steps(25)
    assert machine.set_calls == [1, 2, 1] and machine.governor.threads == 1


def test_a_pause_between_steps_is_not_counted_against_the_thread_count(caplog: pytest.LogCaptureFixture) -> None:
    """One stream, one-second windows: the next request's arrival pauses the steps; counted, the
    pause would make the trial's window look 18 % slower and send one thread back."""
    caplog.set_level("INFO", logger="stageserve.device.kernels.thread_governor")
    machine = Machine(probe_down=True, window_s=1.0)
    machine.load = Machine.HOST_NEEDS_A_CORE
    machine.steps(2.05)
    assert machine.set_calls == [1]
    machine.now += 0.3  # the pause
    machine.steps(1.2)  # the trial's window, 17 % faster by its steps: judged at once
    assert machine.set_calls == [1] and "compute threads 1 kept" in caplog.text


def test_a_tie_keeps_the_small_steps_thread_fewer_but_not_the_large_steps() -> None:
    """Rates within the trial's gain: the small steps' governor keeps one thread (less CPU, no barrier
    for a preemption to stall); a governor without ``probe_down``, its trial down caused by
    contention, goes back."""
    small = Machine(probe_down=True)
    small.load = Machine.ONE_STREAM_TIE
    small.steps(8.2)
    assert small.set_calls == [1]
    large = Machine()
    large.load = {1: (0.0066, 0.3), 2: (0.0065, 0.4)}  # contended at two threads, a tie at one
    large.steps(8.2)
    assert large.set_calls == [1, 2]
