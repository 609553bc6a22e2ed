"""The shared reconnect backoff: exponential delays with jitter and a cap, refusals logged once per change."""

from __future__ import annotations

import logging

from stageserve.backoff import MAX_DELAY_S, Backoff

log = logging.getLogger("test.backoff")


def attempts_within(seconds: float, backoff: Backoff) -> int:
    """Attempts made in the first ``seconds`` by a client that waits exactly the delays it is given."""
    elapsed, attempts = 0.0, 0
    while elapsed < seconds:
        attempts += 1
        elapsed += backoff.next_delay()
    return attempts


def test_delays_double_up_to_the_cap_and_jitter_takes_at_most_half():
    longest = Backoff(log, "peer", rng=lambda: 0.0)
    shortest = Backoff(log, "peer", rng=lambda: 0.999999)
    assert [round(longest.next_delay(), 3) for _ in range(8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert [round(shortest.next_delay(), 3) for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.5, 2.5]
    assert longest.attempts == 8


def test_a_peer_refusing_for_ten_seconds_costs_fewer_than_fifty_attempts():
    # Issue 20: at worst (every delay at its shortest) a client dials 9 times in 10 s.
    assert attempts_within(10.0, Backoff(log, "peer", rng=lambda: 0.999999)) == 9
    assert attempts_within(10.0, Backoff(log, "peer", rng=lambda: 0.0)) == 7


def test_success_starts_over_from_the_first_delay():
    backoff = Backoff(log, "peer", rng=lambda: 0.0)
    for _ in range(5):
        backoff.next_delay()
    backoff.succeeded()
    assert (backoff.attempts, backoff.next_delay()) == (0, 0.1)


def test_a_refusal_is_logged_when_new_when_the_cap_is_reached_and_when_its_reason_changes(caplog):
    backoff = Backoff(log, "device 10.0.0.7:50052", rng=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(20):
            backoff.refused("cannot attach (UNAVAILABLE: warming up)")
        backoff.refused("not ready", logging.INFO)
        backoff.succeeded()
        backoff.refused("not ready", logging.INFO)
    lines = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert lines == [
        (logging.WARNING, "device 10.0.0.7:50052: cannot attach (UNAVAILABLE: warming up); retrying in 0.1 s"),
        (logging.WARNING, f"device 10.0.0.7:50052: cannot attach (UNAVAILABLE: warming up), still, after 6 attempts; "
                          f"retrying every {MAX_DELAY_S:g} s or so (logged again only when the reason changes)"),
        (logging.INFO, "device 10.0.0.7:50052: not ready; retrying in 5.0 s"),
        (logging.INFO, "device 10.0.0.7:50052: not ready; retrying in 0.1 s"),
    ]
