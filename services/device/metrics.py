"""The device service's Prometheus metrics, fed from the executor's ticket and output callbacks.

- ``stageserve_step_period_seconds``: submit of a step -> submit of the next one (idle gaps
  between bursts of traffic included: read it under load).
- ``stageserve_step_device_time_seconds{timing_source}``: submit -> completion observed, per step.
  ``timing_source`` is ``submit_to_completion`` with ``--dispatch async`` and ``blocking_span``
  with ``--dispatch sync`` (as in the trace analyzer: a blocking time never carries the async label).
- ``stageserve_step_batch_size``: sampling rows per step.
- ``stageserve_steps_total{outcome}``: ``ok`` or ``failed`` steps.
- ``stageserve_tickets_in_flight``: tickets submitted whose output is not delivered yet.
- ``stageserve_model_info{model_name, backend, dtype}``: the served model (always 1).
- ``stageserve_constrained_sequences``: sequences with a structured-output matcher held.
- ``stageserve_grammar_compile_seconds{cached}``: time to get a constraint's compiled grammar on
  the grammar worker (``cached="false"``: compiled; ``"true"``: found in the cache).
- Speculative decoding (a device with ``--speculative-method``), per decode row verified:
  ``stageserve_spec_draft_tokens_total`` (drafts the proposer made),
  ``stageserve_spec_accepted_tokens_total`` (drafts the target accepted),
  ``stageserve_spec_position_drafted_total{position}`` / ``..._position_accepted_total{position}``
  (position 0 = the first draft; their ratio is the acceptance rate per position) and
  ``stageserve_spec_accepted_length`` (tokens a drafting row emitted: 1 + accepted; its mean is
  the mean accepted length). Rows cut by a stop condition count what the device accepted.

Times come from the ticket's wall-clock ``submitted_unix_ns`` and the moment the output is handed
on (``time.time_ns``): no per-step state is kept here beyond the previous submit time.
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from stageserve.device.step_ticket import StepResult, StepTicket

# Seconds per step: sub-millisecond (a simulated or tiny step) to seconds (a long prefill).
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 10.0)
COMPILE_BUCKETS_S = (0.00001, 0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ACCEPTED_LENGTH_BUCKETS = tuple(range(1, 17))
TIMING_SOURCES = {"async": "submit_to_completion", "sync": "blocking_span"}


class DeviceMetrics:
    """The device's metric families on ``registry`` (a per-service registry, never the global one).

    Args:
        registry: where the families are registered.
        dispatch: ``async`` or ``sync``; picks the device-time ``timing_source`` label.

    Steps are measured from :meth:`start` on, so the start-up warm-up step is left out.
    """

    def __init__(self, registry: CollectorRegistry, dispatch: str) -> None:
        self.registry = registry
        self._period = Histogram("stageserve_step_period_seconds", "Submit of a step until submit of the next (idle gaps included)",
                                 buckets=STEP_BUCKETS_S, registry=registry)
        device_time = Histogram("stageserve_step_device_time_seconds",
                                "Submit until completion observed, per step; timing_source says how it was measured",
                                ["timing_source"], buckets=STEP_BUCKETS_S, registry=registry)
        self._device_time = device_time.labels(TIMING_SOURCES[dispatch])
        self._batch = Histogram("stageserve_step_batch_size", "Sampling rows per step", buckets=BATCH_BUCKETS, registry=registry)
        steps = Counter("stageserve_steps", "Steps completed on the device, by outcome", ["outcome"], registry=registry)
        self._steps_ok, self._steps_failed = steps.labels("ok"), steps.labels("failed")
        self._in_flight = Gauge("stageserve_tickets_in_flight", "Tickets submitted whose output is not delivered yet", registry=registry)
        self._model = Info("stageserve_model", "The model this device serves", registry=registry)
        self._constrained = Gauge("stageserve_constrained_sequences", "Sequences with a structured-output matcher held", registry=registry)
        self._compile = Histogram("stageserve_grammar_compile_seconds", "Getting a constraint's compiled grammar, by whether it was cached",
                                  ["cached"], buckets=COMPILE_BUCKETS_S, registry=registry)
        self._spec_drafted = Counter("stageserve_spec_draft_tokens", "Drafts the proposer made (speculative decoding)", registry=registry)
        self._spec_accepted = Counter("stageserve_spec_accepted_tokens", "Drafts the target model accepted", registry=registry)
        self._position_drafted = Counter("stageserve_spec_position_drafted", "Rows with a draft at this position (0 = first draft)",
                                         ["position"], registry=registry)
        self._position_accepted = Counter("stageserve_spec_position_accepted", "Rows whose draft at this position was accepted",
                                          ["position"], registry=registry)
        self._accepted_length = Histogram("stageserve_spec_accepted_length", "Tokens a row with drafts emitted in one step (1 + accepted)",
                                          buckets=ACCEPTED_LENGTH_BUCKETS, registry=registry)
        self._last_submit_ns = 0
        self._measuring = False

    def describe_model(self, model_name: str, backend: str, dtype: str) -> None:
        """Report the served model as ``stageserve_model_info`` (once it is loaded)."""
        self._model.info({"model_name": model_name, "backend": backend, "dtype": dtype})

    def start(self) -> None:
        """Measure the steps submitted from now on (call after the warm-up)."""
        self._measuring = True

    def watch_in_flight(self, in_flight: Callable[[], int]) -> None:
        """Read the in-flight gauge from ``in_flight()`` (the executor's count) at every scrape."""
        self._in_flight.set_function(in_flight)

    def watch_constrained(self, count: Callable[[], int]) -> None:
        """Read the constrained-sequences gauge from ``count()`` (the grammar table's) at every scrape."""
        self._constrained.set_function(count)

    def on_compile(self, cached: bool, seconds: float) -> None:
        """A constraint's compiled grammar was got in ``seconds`` (from the cache when ``cached``)."""
        self._compile.labels(str(cached).lower()).observe(seconds)

    def on_ticket(self, ticket: StepTicket) -> None:
        """A step was submitted (called in submission order, by the one submitter)."""
        if not self._measuring:
            return
        if self._last_submit_ns:
            self._period.observe((ticket.submitted_unix_ns - self._last_submit_ns) / 1e9)
        self._last_submit_ns = ticket.submitted_unix_ns
        self._batch.observe(len(ticket.admitted.step.sampled_seq_index))

    def on_output(self, ticket: StepTicket, result: StepResult | None, error: BaseException | None) -> None:
        """A step's completion was observed (the executor's completion thread)."""
        if not self._measuring:
            return
        self._device_time.observe((time.time_ns() - ticket.submitted_unix_ns) / 1e9)
        (self._steps_failed if error is not None else self._steps_ok).inc()
        if result is not None and result.num_drafted is not None:
            self._observe_speculation(result.num_tokens, result.num_drafted)

    def _observe_speculation(self, num_tokens: list[int], num_drafted: list[int]) -> None:
        for emitted, drafted in zip(num_tokens, num_drafted):
            if not drafted:
                continue
            accepted = emitted - 1
            self._spec_drafted.inc(drafted)
            self._spec_accepted.inc(accepted)
            self._accepted_length.observe(emitted)
            for position in range(drafted):
                self._position_drafted.labels(str(position)).inc()
                if position < accepted:
                    self._position_accepted.labels(str(position)).inc()
