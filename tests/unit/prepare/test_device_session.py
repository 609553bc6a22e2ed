"""One device session against a fake device (``fake_peers.py``) that refuses ``Attach``: it is
retried with the shared backoff, and the refusal is logged once, not once per attempt."""

from __future__ import annotations

import logging
import threading
import time

from stageserve.prepare.engine import Engine
from stageserve.prepare.session import DeviceSession

from .fake_peers import FakePeers


def test_a_device_refusing_attach_is_retried_with_backoff_and_logged_once(caplog):
    peers = FakePeers()
    peers.device.refuse_attach = "warming up"
    reclaim_up = threading.Event()
    reclaim_up.set()
    address = f"127.0.0.1:{peers.device_port}"
    session = DeviceSession(address, Engine(max_prefill_chunk=16, max_waiting=8), reclaim_up, on_change=lambda: None, step_timeout_s=10)
    try:
        with caplog.at_level(logging.INFO, logger="stageserve.prepare.session"):
            started = time.monotonic()
            session.start()
            while peers.device.attach_calls < 5:
                assert time.monotonic() - started < 30, f"only {peers.device.attach_calls} attempts"
                time.sleep(0.01)
            elapsed_s = time.monotonic() - started
            attached = session.attached
    finally:
        session.stop()
        peers.stop()
    assert not attached
    # The 5th attempt comes after 4 delays, each at least half its nominal 0.1, 0.2, 0.4, 0.8 s.
    assert elapsed_s >= 0.05 + 0.1 + 0.2 + 0.4
    refusals = [record.getMessage() for record in caplog.records if "cannot attach" in record.getMessage()]
    assert len(refusals) == 1
    assert refusals[0].startswith(f"device {address}: cannot attach (UNAVAILABLE: warming up); retrying in ")


def test_a_device_refusing_attach_for_ten_seconds_costs_fewer_than_fifty_attempts():
    """Issue 20: 27,309 attach cycles in 110 s before the backoff; now a handful, and it attaches after."""
    peers = FakePeers()
    peers.device.refuse_attach = "warming up"
    reclaim_up = threading.Event()
    reclaim_up.set()
    session = DeviceSession(f"127.0.0.1:{peers.device_port}", Engine(max_prefill_chunk=16, max_waiting=8), reclaim_up,
                            on_change=lambda: None, step_timeout_s=10)
    try:
        session.start()
        time.sleep(10)
        refused_attempts = peers.device.attach_calls
        peers.device.refuse_attach = ""
        deadline = time.monotonic() + 30
        while not session.attached:
            assert time.monotonic() < deadline, "never attached once the device accepted"
            time.sleep(0.05)
    finally:
        session.stop()
        peers.stop()
    assert 5 <= refused_attempts < 50  # the delays' lower bounds allow 10 at most in 10 s
