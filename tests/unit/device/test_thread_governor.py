"""The compute-thread governor's rule, on a scripted clock and run-queue wait (the real signal is
the kernel's schedstat; what the rule does with it is what is tested here), and its signal read
from this process."""

from __future__ import annotations

from stageserve.device.thread_governor import ComputeThreadGovernor, process_run_queue_wait_s


class Machine:
    """A scripted clock and a run-queue wait that grows, per second of steps, by threads x the wait per thread
    that ``load`` gives for that many threads (figures measured on 2 cores, see thread_governor.py)."""

    QUIET = {1: 0.17, 2: 0.2}
    ONE_CORE_BUSY = {1: 0.24, 2: 0.42}

    def __init__(self) -> None:
        self.now, self.wait, self.load, self.set_calls = 0.0, 0.0, self.QUIET, []
        self.governor = ComputeThreadGovernor(2, clock=lambda: self.now, read_wait=lambda: self.wait, set_threads=self.set_calls.append)

    def steps(self, seconds: float, step_s: float = 0.05, idle_s: float = 0.0) -> None:
        """Steps of ``step_s`` (with ``idle_s`` between them) for ``seconds``."""
        end = self.now + seconds
        while self.now < end:
            self.governor.run(self._step(step_s))
            self.now += idle_s

    def _step(self, step_s: float):
        def step() -> None:
            self.now += step_s
            self.wait += self.load[self.governor.threads] * self.governor.threads * step_s
        return step


def test_a_quiet_machine_keeps_every_thread() -> None:
    machine = Machine()
    machine.steps(120)
    assert machine.governor.threads == 2
    assert machine.set_calls == []


def test_contention_drops_a_thread_after_two_windows_and_a_probe_brings_it_back_when_it_ends() -> None:
    machine = Machine()
    machine.load = Machine.ONE_CORE_BUSY
    machine.steps(3.9)
    assert machine.governor.threads == 2  # one contended window is not enough
    machine.steps(0.2)
    assert machine.set_calls == [1]
    machine.load = Machine.QUIET  # the other process ended
    machine.steps(29)
    assert machine.governor.threads == 1  # not before probe_after_s
    machine.steps(4)
    assert machine.set_calls == [1, 2]
    machine.steps(60)
    assert machine.governor.threads == 2


def test_a_failed_probe_goes_back_and_the_next_waits_twice_as_long() -> None:
    machine = Machine()
    machine.load = Machine.ONE_CORE_BUSY
    machine.steps(4.1)
    machine.steps(31)  # the probe, at 30 s after the change
    assert machine.set_calls[:2] == [1, 2]
    machine.steps(4.1)  # still contended: back to 1
    assert machine.set_calls == [1, 2, 1]
    machine.steps(55)
    assert machine.set_calls == [1, 2, 1]  # the next probe waits 60 s
    machine.steps(6)
    assert machine.set_calls == [1, 2, 1, 2]


def test_an_idle_device_decides_nothing() -> None:
    machine = Machine()
    machine.load = {2: 5.0}  # huge, but the device computes a tenth of the time
    machine.steps(60, step_s=0.01, idle_s=0.09)
    assert machine.set_calls == []


def test_the_run_queue_wait_of_this_process_is_read_and_grows() -> None:
    first = process_run_queue_wait_s()
    assert first >= 0.0
    assert process_run_queue_wait_s() >= first
