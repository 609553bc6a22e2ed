"""prepare's Prometheus metrics and the per-request observer that feeds them.

prepare sees every request from acceptance to its terminal message, so the request-level figures
live here: requests by finish reason and status code, time to first token (TTFT), inter-token
latency (ITL), end-to-end latency, queue time, prompt and generated tokens, running / waiting
requests, KV blocks used / free and the fraction used, the served model (an info metric), each
request's prefill and decode time, and the host time of each step's scheduling work.

Where each figure is measured (all on ``time.monotonic_ns``, the tracer's clock):

- accepted: ``Engine.submit`` (:attr:`RequestHandle.accepted_ns`);
- queue time: accepted -> the step loop schedules the request's first row;
- prefill time: that first row scheduled -> its first token forwarded; decode time: first token
  forwarded -> the terminal message (requests that finished with a finish reason);
- TTFT / ITL / e2e: accepted -> the RPC handler is about to forward a chunk with tokens / the
  terminal message (:class:`RequestObserver`);
- step host time: ``prepare.schedule`` start -> ``prepare.send`` end of each step.

The same moments are written as ``request.*`` trace events (see :mod:`stageserve.tracing`) while
the tracer records.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from stageserve.metric_buckets import STEP_HOST_BUCKETS_S
from stageserve.prepare.placement import DeviceLoad
from stageserve.tracing import Tracer, clock_ns
from stageserve.v1 import common_pb2

# Seconds; request latencies span ms (a short decode) to minutes (long generations).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Seconds between tokens of one stream: about one step period.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

FINISH_REASON_LABELS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
ERROR_LABEL = "error"  # finish_reason of a request that ended (or was refused) with a gRPC error status


class PrepareMetrics:
    """prepare's metric families on ``registry`` (a per-service registry, never the global one).

    Attributes:
        requests: ``stageserve_requests_total{finish_reason, code}``; ``finish_reason`` is
            stop / length / abort / error, ``code`` the gRPC status name (OK on a normal finish).
        ttft, itl, e2e, queue_time, prefill_time, decode_time: latency histograms in seconds.
        prompt_tokens, generation_tokens: token counters of accepted requests / forwarded tokens.
        step_host: host seconds per step (schedule + build plan + send).
        prefix_cache_queries, prefix_cache_hits: prompt tokens of admitted requests looked up in
            the prefix cache / found there (never prefilled); ``hits / queries`` is the hit rate.
        prefix_cache_evictions: cached blocks taken back by the pool for new KV.
        kv_window_released: KV blocks running sequences released because every layer's sliding
            window had left them behind (``AttachReply.kv_window``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter("stageserve_requests", "Requests ended, by finish reason and gRPC status code (refusals included)",
                                ["finish_reason", "code"], registry=registry)
        self.ttft = Histogram("stageserve_time_to_first_token_seconds", "Accepted until the first token is forwarded to the client",
                              buckets=LATENCY_BUCKETS_S, registry=registry)
        self.itl = Histogram("stageserve_inter_token_latency_seconds", "Gap between forwarded tokens of one request (a chunk of k tokens counts k gaps of 1/k)",
                             buckets=ITL_BUCKETS_S, registry=registry)
        self.e2e = Histogram("stageserve_e2e_request_latency_seconds", "Accepted until the final chunk, for requests that finished with a finish reason",
                             buckets=LATENCY_BUCKETS_S, registry=registry)
        self.queue_time = Histogram("stageserve_request_queue_time_seconds", "Accepted until the first row of the request is scheduled",
                                    buckets=LATENCY_BUCKETS_S, registry=registry)
        self.prefill_time = Histogram("stageserve_request_prefill_time_seconds", "First row of the request scheduled until its first token is forwarded",
                                      buckets=LATENCY_BUCKETS_S, registry=registry)
        self.decode_time = Histogram("stageserve_request_decode_time_seconds", "First token forwarded until the final chunk, for requests that finished with a finish reason",
                                     buckets=LATENCY_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("stageserve_prompt_tokens", "Prompt tokens of accepted requests", registry=registry)
        self.generation_tokens = Counter("stageserve_generation_tokens", "Generated tokens forwarded to clients", registry=registry)
        self.step_host = Histogram("stageserve_host_critical_path_seconds",
                                   "prepare's host work per step on the critical path: schedule + build plan + send",
                                   buckets=STEP_HOST_BUCKETS_S, registry=registry)
        self.prefix_cache_queries = Counter("stageserve_prefix_cache_queries_tokens", "Prompt tokens of admitted requests looked up in the prefix cache",
                                            registry=registry)
        self.prefix_cache_hits = Counter("stageserve_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache (not prefilled)",
                                         registry=registry)
        self.prefix_cache_evictions = Counter("stageserve_prefix_cache_evictions_blocks", "Cached KV blocks evicted to make room",
                                              registry=registry)
        self.kv_window_released = Counter("stageserve_kv_cache_window_released_blocks",
                                          "KV blocks released by running sequences whose sliding window left them behind", registry=registry)

    def watch_engine(self, load: Callable[[], DeviceLoad | None]) -> None:
        """Report running / waiting requests, KV blocks and the served model from ``load()`` at every
        scrape (``None`` while no device is attached: the gauges read 0 and no model is reported)."""
        self.registry.register(_DeviceLoadCollector(load))

    def request_refused(self, code_name: str) -> None:
        """A request refused before it was accepted (validation, queue full, not connected)."""
        self.requests.labels(ERROR_LABEL, code_name).inc()


class _DeviceLoadCollector(Collector):
    """Gauges read from the engine at scrape time, so the step loop never updates them."""

    def __init__(self, load: Callable[[], DeviceLoad | None]) -> None:
        self._load = load

    def collect(self) -> Iterator[GaugeMetricFamily]:
        load = self._load()
        used = load.kv_blocks_total - load.kv_blocks_free if load else 0
        yield GaugeMetricFamily("stageserve_requests_running", "Requests holding a sequence slot", value=load.running if load else 0)
        yield GaugeMetricFamily("stageserve_requests_waiting", "Requests waiting for admission", value=load.waiting if load else 0)
        yield GaugeMetricFamily("stageserve_kv_cache_blocks_used", "KV cache blocks holding a sequence's tokens", value=used)
        yield GaugeMetricFamily("stageserve_kv_cache_blocks_free", "KV cache blocks holding no sequence's tokens (reserved ones included)",
                                value=load.kv_blocks_free if load else 0)
        yield GaugeMetricFamily("stageserve_kv_cache_blocks_cached", "KV cache blocks in the prefix cache (shareable; held by a sequence or not)",
                                value=load.kv_blocks_cached if load else 0)
        yield GaugeMetricFamily("stageserve_kv_cache_usage_ratio", "Fraction of the KV cache blocks holding tokens, 0 to 1",
                                value=used / load.kv_blocks_total if load and load.kv_blocks_total else 0)
        if load:
            yield InfoMetricFamily("stageserve_model", "The model the attached devices serve",
                                   value={"model_name": load.attach.model_name, "backend": load.attach.backend, "dtype": load.attach.dtype})


class RequestObserver:
    """One accepted request as its RPC handler forwards it: metrics and ``request.*`` trace events.

    Call :meth:`on_event` with each event before it is forwarded, then exactly one of the
    terminal calls (:meth:`on_event` with a finish reason, :meth:`on_error`, :meth:`on_client_gone`);
    later calls are ignored. Not thread-safe: the request's RPC handler owns it, except for
    :meth:`on_scheduled`, which the step loop calls before any event of the request exists.

    Args:
        request_id: the request's id (the async-span id in the trace).
        accepted_ns: ``clock_ns()`` when the engine accepted it.
    """

    __slots__ = ("_metrics", "_tracer", "_request_id", "_accepted_ns", "_scheduled_ns", "_first_token_ns", "_last_token_ns", "_ended")

    def __init__(self, metrics: PrepareMetrics, tracer: Tracer, request_id: str, accepted_ns: int) -> None:
        self._metrics, self._tracer = metrics, tracer
        self._request_id, self._accepted_ns = request_id, accepted_ns
        self._scheduled_ns = self._first_token_ns = self._last_token_ns = 0
        self._ended = False

    def on_scheduled(self, now_ns: int) -> None:
        """The request's first row was scheduled at ``now_ns`` (the step loop, before any token of it
        can be forwarded): its prefill time starts."""
        self._scheduled_ns = now_ns

    def on_event(self, event) -> None:
        """A ``SequenceEvent`` about to be forwarded (tokens, and/or the finish)."""
        tokens = len(event.token_ids)
        if tokens:
            now = clock_ns()
            metrics, tracer = self._metrics, self._tracer
            if self._last_token_ns == 0:
                metrics.ttft.observe((now - self._accepted_ns) / 1e9)
                self._first_token_ns = now
                if self._scheduled_ns:
                    metrics.prefill_time.observe((now - self._scheduled_ns) / 1e9)
                tracer.end_async("request.ttft", self._request_id)
            else:
                gap_s = (now - self._last_token_ns) / 1e9 / tokens
                for _ in range(tokens):
                    metrics.itl.observe(gap_s)
            self._last_token_ns = now
            metrics.generation_tokens.inc(tokens)
            tracer.instant_async("request.token", self._request_id, tokens=tokens)
        if event.finish_reason:
            self._end(FINISH_REASON_LABELS.get(event.finish_reason, "unknown"), "OK")

    def on_error(self, code_name: str) -> None:
        """The request ended with the gRPC status ``code_name`` (e.g. ``UNAVAILABLE``)."""
        self._end(ERROR_LABEL, code_name)

    def on_client_gone(self, deadline_passed: bool = False) -> None:
        """The client cancelled or disconnected (``CANCELLED``), or its deadline passed
        (``DEADLINE_EXCEEDED``), before the terminal message."""
        self._end("abort", "DEADLINE_EXCEEDED" if deadline_passed else "CANCELLED")

    def _end(self, finish_reason: str, code_name: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._metrics.requests.labels(finish_reason, code_name).inc()
        if code_name == "OK":
            now = clock_ns()
            self._metrics.e2e.observe((now - self._accepted_ns) / 1e9)
            if self._first_token_ns:
                self._metrics.decode_time.observe((now - self._first_token_ns) / 1e9)
        tracer = self._tracer
        if self._last_token_ns == 0:  # close the TTFT span; no_token marks that no token came
            tracer.end_async("request.ttft", self._request_id, no_token=True)
        tracer.end_async("request.total", self._request_id, finish_reason=finish_reason, code=code_name)
