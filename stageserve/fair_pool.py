"""A thread pool that tenants take in turns: one tenant's burst of expensive tasks cannot hold every
worker, nor queue in front of another tenant's tasks.

Used by the device for grammar compiles (``device/grammar.py``) and by prepare for tokenization and
validation (``prepare/frontend.py``), each task tagged with its tenant, the API key's name. Tasks
are taken round robin across the tenants that have one queued, oldest first within a tenant, and
at most ``per_tenant`` of one tenant's tasks run at once (the scheme of deficit round robin with a
quantum of one task: Shreedhar and Varghese, "Efficient Fair Queuing using Deficit Round Robin",
SIGCOMM 1995). The tenant ``""`` (everyone, on a deployment without keys) has no limit of its own.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

EVERYONE = ""
"""The tenant of every task on a deployment without API keys: bounded by the workers only."""


class FairPool:
    """``workers`` threads running tenants' tasks in turns (see the module docstring).

    Args:
        workers: threads.
        per_tenant: tasks of one named tenant running at once, at most.
        name: the threads' name prefix.
        niceness: added to each thread's nice value (Linux: per thread), so that the tasks yield the
            CPU to the process's other threads (the device's steps); 0 = as the process.
    """

    def __init__(self, workers: int, per_tenant: int, name: str, niceness: int = 0) -> None:
        self._per_tenant = per_tenant
        self._niceness = niceness
        self._queues: OrderedDict[str, deque[tuple[Future, Callable[[], Any]]]] = OrderedDict()
        self._running: dict[str, int] = {}
        self._closed = False
        self._cond = threading.Condition()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)`` for ``tenant``'s turn; the future gets its result or exception."""
        future: Future = Future()
        with self._cond:
            self._queues.setdefault(tenant, deque()).append((future, lambda: fn(*args)))
            self._cond.notify()
        return future

    def close(self) -> None:
        """Start no more tasks and wait for the running ones (for the end of the process: a task
        inside native code, as an xgrammar compile, cannot be interrupted)."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: not self._running)

    def _may_run(self, tenant: str) -> bool:
        return tenant == EVERYONE or self._running.get(tenant, 0) < self._per_tenant

    def _take(self) -> tuple[str, Future, Callable[[], Any]]:
        with self._cond:
            while True:
                tenant = None if self._closed else next((t for t in self._queues if self._may_run(t)), None)
                if tenant is not None:
                    queue = self._queues.pop(tenant)  # its next task waits for the other tenants' turns
                    future, task = queue.popleft()
                    if queue:
                        self._queues[tenant] = queue
                    self._running[tenant] = self._running.get(tenant, 0) + 1
                    return tenant, future, task
                self._cond.wait()

    def _work(self) -> None:
        if self._niceness:
            try:
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._niceness)
            except (AttributeError, OSError):  # no per-thread priority here: the tasks run as the process
                pass
        while True:
            tenant, future, task = self._take()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(task())
                    except BaseException as exc:  # noqa: BLE001 - the submitter gets it
                        future.set_exception(exc)
            finally:
                with self._cond:
                    self._running[tenant] -= 1
                    if not self._running[tenant]:
                        del self._running[tenant]
                    self._cond.notify_all()
