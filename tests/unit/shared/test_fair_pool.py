"""`FairPool`: tenants take the workers in turns, a named tenant runs at most ``per_tenant`` tasks at
once, and everyone's tenant ("") is bounded by the workers only."""

from __future__ import annotations

import threading

from stageserve.fair_pool import EVERYONE, FairPool


def test_a_tenants_burst_holds_only_its_share_and_the_others_go_in_turns():
    pool = FairPool(workers=2, per_tenant=1, name="test-fair")
    gate = threading.Event()
    order, lock = [], threading.Lock()

    def task(tag: str) -> str:
        with lock:
            order.append(tag)
        if tag.startswith("a"):
            gate.wait(10)
        return tag

    a = [pool.submit("team-a", task, f"a{i}") for i in range(3)]  # a0 runs and blocks; a1, a2 wait for it
    b = [pool.submit("team-b", task, f"b{i}") for i in range(3)]  # the other worker serves team-b meanwhile
    assert [future.result(10) for future in b] == ["b0", "b1", "b2"]
    assert order == ["a0", "b0", "b1", "b2"]
    gate.set()
    assert [future.result(10) for future in a] == ["a0", "a1", "a2"]
    pool.close()


def test_everyones_tasks_use_every_worker_and_exceptions_reach_the_submitter():
    pool = FairPool(workers=3, per_tenant=1, name="test-fair")
    barrier = threading.Barrier(3, timeout=10)
    futures = [pool.submit(EVERYONE, barrier.wait) for _ in range(3)]  # would deadlock with one at a time
    assert sorted(future.result(10) for future in futures) == [0, 1, 2]
    failed = pool.submit("team-a", lambda: 1 / 0)
    assert isinstance(failed.exception(10), ZeroDivisionError)
    pool.close()
