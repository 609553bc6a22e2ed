"""Reconnecting with backoff: how long to wait before the next attempt to reach a peer, and which
failed attempts are worth a log line.

prepare (its device sessions and its reclaim subscription) and reclaim (its completion links) dial
peers that may not be up yet, may refuse (loading, draining) or may go away. They all retry the
same way, through one :class:`Backoff` per connection:

- **delays**: exponential from ``INITIAL_DELAY_S``, times ``MULTIPLIER`` per failed attempt, capped
  at ``MAX_DELAY_S``; each delay drawn uniformly from ``[d / 2, d]`` ("equal jitter", M. Brooker,
  "Exponential Backoff And Jitter", AWS Architecture Blog, 2015), so that clients that lost the
  same peer do not retry in lockstep, while a refusing peer still costs a bounded number of
  attempts (9 at most in the first 10 s: the delays' lower bounds add up to 10.65 s by the 10th);
- **logging**: a refusal is logged when it is news (the first failed attempt, a different reason
  than the previous one) and once more when the delay reaches its cap; repeats are not. A device
  that refuses for minutes writes two lines, not hundreds.
"""

from __future__ import annotations

import logging
import random
from typing import Callable

INITIAL_DELAY_S = 0.1
MAX_DELAY_S = 5.0
MULTIPLIER = 2.0


class Backoff:
    """Attempts to reach one peer: delays and refusal logging (see the module docstring).

    Not thread-safe: the one thread that dials the peer owns it.

    Args:
        log: where refusals are logged.
        peer: how log lines name the peer (e.g. ``"device 10.0.0.7:50052"``).
        initial_s, max_s: first nominal delay and the cap, in seconds.
        rng: returns a float in ``[0, 1)`` per delay (tests pass a constant).
    """

    def __init__(self, log: logging.Logger, peer: str, initial_s: float = INITIAL_DELAY_S, max_s: float = MAX_DELAY_S,
                 rng: Callable[[], float] = random.random) -> None:
        self._log, self._peer = log, peer
        self._initial_s, self._max_s, self._rng = initial_s, max_s, rng
        self._nominal_s = initial_s
        self._last_reason: str | None = None
        self.attempts = 0  # failed attempts since the last success

    def next_delay(self) -> float:
        """Count a failed attempt; return the seconds to wait before the next one (no log line)."""
        self.attempts += 1
        delay = self._nominal_s * (1.0 - self._rng() / 2)
        self._nominal_s = min(self._nominal_s * MULTIPLIER, self._max_s)
        return delay

    def refused(self, reason: str, level: int = logging.WARNING) -> float:
        """Count an attempt that failed because of ``reason``; log it at ``level`` when it is news;
        return the seconds to wait before the next attempt."""
        capped_before = self._nominal_s >= self._max_s
        delay = self.next_delay()
        if reason != self._last_reason:
            self._log.log(level, "%s: %s; retrying in %.1f s", self._peer, reason, delay)
        elif not capped_before and self._nominal_s >= self._max_s:
            self._log.log(level, "%s: %s, still, after %d attempts; retrying every %g s or so (logged again only when the reason changes)",
                          self._peer, reason, self.attempts, self._max_s)
        self._last_reason = reason
        return delay

    def succeeded(self) -> None:
        """The peer answered: the next failure starts again from the first delay and is logged."""
        self._nominal_s = self._initial_s
        self._last_reason = None
        self.attempts = 0
