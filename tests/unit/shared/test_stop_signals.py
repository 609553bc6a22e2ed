"""`StopRequest`: a signal handler that asks for a stop never deadlocks the thread waiting for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

from stageserve.stop_signals import StopRequest

ROUNDS = 200

# Each round: a thread sends SIGINT 5-10 ms later while the main thread polls as tightly as it can.
# With `threading.Event` in place of StopRequest (handler: event.set()) the process hangs within a
# few rounds: the handler runs while `Event.wait` holds the event's lock (120 of 200 single rounds).
CHILD = textwrap.dedent(f"""
    import os, random, signal, threading, time
    from stageserve.stop_signals import StopRequest
    def send_sigint_soon():
        time.sleep(0.005 + random.random() * 0.005)
        os.kill(os.getpid(), signal.SIGINT)
    for _ in range({ROUNDS}):
        stop = StopRequest()
        stop.handle_signals()
        threading.Thread(target=send_sigint_soon).start()
        while not stop.wait(0):
            pass
    print("rounds done")
""")


def test_a_signal_storm_never_deadlocks_the_waiter():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rounds done"


def test_wait_returns_false_on_timeout_and_true_once_requested_from_another_thread():
    stop = StopRequest()
    assert stop.wait(0.01) is False and not stop.requested
    threading.Timer(0.05, stop.request).start()
    assert stop.wait(10) is True and stop.requested


def test_each_stop_signal_requests_the_stop():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        for sig in previous:
            stop = StopRequest()
            stop.handle_signals()
            os.kill(os.getpid(), sig)
            assert stop.wait(10), sig.name
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
