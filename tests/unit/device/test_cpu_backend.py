"""`CpuBackend` with ``on_caller``: steps run on the thread inside `serve_while` (the device
service's main thread), in launch order, with errors and results handed back to that thread."""

from __future__ import annotations

import threading

import pytest
import torch

from stageserve.device.backends import CpuBackend


def test_steps_run_on_the_thread_inside_serve_while():
    backend = CpuBackend(on_caller=True)
    ran_on: list[str] = []

    def control() -> str:
        completions = [backend.launch(lambda i=i: ran_on.append(f"{i}:{threading.current_thread().name}")) for i in range(3)]
        assert all(c.wait(10) for c in completions)
        return threading.current_thread().name

    control_thread = backend.serve_while(control)
    here = threading.current_thread().name
    assert ran_on == [f"0:{here}", f"1:{here}", f"2:{here}"]  # in launch order, on this thread
    assert control_thread != here
    backend.close()


def test_a_step_launched_outside_serve_while_waits_for_it():
    backend = CpuBackend(on_caller=True)
    completion = backend.launch(lambda: None)
    assert completion.wait(0.05) is False  # nobody runs steps yet
    assert backend.serve_while(lambda: completion.wait(10)) is True
    backend.close()


def test_serve_while_reraises_the_error_of_its_function_and_steps_keep_theirs():
    backend = CpuBackend(on_caller=True)

    def failing_step() -> None:
        raise ValueError("step failed")

    completion = backend.launch(failing_step)
    with pytest.raises(ValueError, match="step failed"):
        backend.serve_while(lambda: completion.wait(10))

    def control() -> None:
        raise KeyError("control failed")

    with pytest.raises(KeyError, match="control failed"):
        backend.serve_while(control)
    backend.close()


def test_without_on_caller_serve_while_just_calls():
    backend = CpuBackend()
    assert backend.serve_while(lambda: threading.current_thread().name) == threading.current_thread().name
    assert backend.launch(lambda: None).wait(10)
    backend.close()


def test_ctrl_c_during_a_step_fails_the_step_and_stops_the_caller():
    """A KeyboardInterrupt on the calling (main) thread is not swallowed as a step error."""
    backend = CpuBackend(on_caller=True)

    def interrupted() -> None:
        raise KeyboardInterrupt

    completion = backend.launch(interrupted)
    with pytest.raises(KeyboardInterrupt):
        backend.serve_while(lambda: completion.wait(10))
    with pytest.raises(KeyboardInterrupt):
        completion.wait(0)  # the step's own waiters see it too
    backend.close()


def test_small_and_large_steps_run_at_their_own_governors_thread_counts():
    """With ``adaptive_threads``, a step of at most ``SMALL_STEP_ROWS`` rows runs with the small steps'
    governor's thread count and a larger one with the other's, each set on the compute thread."""
    before = torch.get_num_threads()
    backend = CpuBackend(threads=2, on_caller=True, adaptive_threads=True)
    small, large = backend._governors
    small.threads = 1  # as a kept trial of the small steps' governor leaves it
    seen: list[int] = []

    def control() -> None:
        rows = [1, 32, CpuBackend.SMALL_STEP_ROWS, CpuBackend.SMALL_STEP_ROWS + 1]
        assert all(backend.launch(lambda: seen.append(torch.get_num_threads()), n).wait(10) for n in rows)

    try:
        backend.serve_while(control)
        assert seen == [1, 2, 1, 2] and large.threads == 2
    finally:
        backend.close()
        torch.set_num_threads(before)
