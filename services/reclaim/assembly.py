"""Assembly of the reclaim service: its gRPC server with the ``Subscribe`` servicer, metrics and tracer
(:func:`open_server`), then the tokenizer and one completion link per device (:func:`attach_devices`).
``stageserve reclaim`` (``main.py``) serves and drains what they build.
"""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from stageserve.metrics_http import start_metrics_server
from stageserve.process_memory import return_freed_memory
from stageserve.reclaim.detokenizer import IncrementalDetokenizer, decoder_for
from stageserve.reclaim.links import CompletionLink, CompletionLinks
from stageserve.reclaim.metrics import ReclaimMetrics
from stageserve.reclaim.publisher import Publisher
from stageserve.reclaim.service import SERVICE_NAME, ReclaimServicer
from stageserve.security.config import ServiceSecurity
from stageserve.server import ServiceServer, profile_dir
from stageserve.tokenizer import load_fast_tokenizer
from stageserve.tracing import Tracer
from stageserve.v1 import reclaim_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReclaimServer:
    """reclaim's gRPC ``server`` (started, readiness NOT_SERVING), the ``publisher`` its servicer reads, its tracer and metrics."""

    server: ServiceServer
    publisher: Publisher
    tracer: Tracer
    metrics: ReclaimMetrics


def open_server(args: argparse.Namespace, security: ServiceSecurity) -> ReclaimServer:
    """Listen with the ``Subscribe`` servicer (NOT_SERVING until a device is attached), serve metrics, start tracing.

    Raises:
        ValueError, RuntimeError, OSError: the port, the metrics port or the trace folder cannot be used.
    """
    tracer = Tracer("reclaim")
    metrics = ReclaimMetrics(CollectorRegistry())
    server = ServiceServer(SERVICE_NAME, args.host, args.port, port_file=args.port_file, tracer=tracer, security=security,
                           profile_dir=profile_dir(args))
    start_metrics_server(metrics.registry, args.host, args.metrics_port, args.port_file)
    if args.trace_dir is not None:
        tracer.start(args.trace_dir)
    publisher = Publisher(args.subscriber_queue_steps, args.max_subscribers)
    server.add_servicer(reclaim_pb2_grpc.add_ReclaimServicer_to_server, ReclaimServicer(publisher))
    server.start([SERVICE_NAME])
    return ReclaimServer(server, publisher, tracer, metrics)


def attach_devices(args: argparse.Namespace, model_path: Path, reclaim: ReclaimServer, security: ServiceSecurity,
                   draining: threading.Event) -> CompletionLinks:
    """Load the tokenizer and build one completion link per ``--device`` address (not started).

    Readiness is SERVING while at least one device is attached and ``draining`` is not set.
    """
    detokenizer = IncrementalDetokenizer(decoder_for(load_fast_tokenizer(model_path)))
    return_freed_memory()  # what reading the tokenizer freed
    log.info("tokenizer loaded from %s", model_path.name)
    links = CompletionLinks(
        args.device, args.device_refresh_s,
        new_link=lambda address, set_attached: CompletionLink(address, detokenizer, reclaim.publisher, args.completion_timeout, set_attached,
                                                              tracer=reclaim.tracer, metrics=reclaim.metrics, tls=security.tls),
        on_ready=lambda up: reclaim.server.set_ready(up and not draining.is_set()),
    )
    reclaim.metrics.watch_live(lambda: links.live)
    return links
