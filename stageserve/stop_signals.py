"""A stop request that signal handlers may make: SIGTERM, SIGINT (Ctrl-C) and SIGHUP (the terminal
hung up) all ask a process to stop cleanly.

Why not ``threading.Event``: Python runs a signal handler on the main thread, between two bytecodes
of whatever that thread is doing. When the main thread is inside ``Event.wait`` it holds the
event's (non-reentrant) lock for a few bytecodes around the actual wait; a handler that calls
``Event.set`` then blocks on that lock forever, and so does every later signal's handler. A loop
``while not event.wait(0):`` deadlocks on 120 of 200 SIGINTs; with the 0.2-0.5 s waits the services
and ``stageserve up`` used it happened once in a few hundred stops under load (the ``^C`` was echoed
and nothing stopped). :class:`StopRequest` takes no lock: the handler assigns a flag, the waiter
polls it between short sleeps (a sleep that a signal interrupts returns to Python, which runs the
handler at once; a signal that lands on another thread is seen within one poll).
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.05


class StopRequest:
    """A lock-free, one-way stop flag: :meth:`request` (any thread, or a signal handler) and
    :meth:`wait` (any thread)."""

    def __init__(self) -> None:
        self._requested = False

    @property
    def requested(self) -> bool:
        return self._requested

    def request(self) -> None:
        """Ask for the stop. Takes no lock, so a signal handler may call it."""
        self._requested = True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`request` (True) or ``timeout_s`` seconds pass (False; None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._requested:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic())))
        return True

    def handle_signals(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        """Make each of ``signals`` call :meth:`request`. Main thread only (Python's rule for handlers)."""
        for sig in signals:
            signal.signal(sig, lambda *_: self.request())
