"""Assembly of the prepare service: tracer, metrics, tokenizer, the public gRPC server, the links to the
devices and reclaim, the router, the frontend both APIs share and, with ``--http-port``, the
OpenAI-compatible HTTP server: :func:`build_prepare`. ``stageserve prepare`` (``main.py``) serves it.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("stageserve.prepare")


@dataclass(frozen=True)
class PrepareService:
    """A started prepare service: its gRPC ``server`` (listening, readiness NOT_SERVING), the
    ``connector`` to its peers (not started yet), the ``router`` and the HTTP server (or ``None``)."""

    server: object  # stageserve.server.AioServiceServer
    connector: object  # stageserve.prepare.connector.PipelineConnector
    router: object  # stageserve.prepare.router.DeviceRouter
    http: object | None  # stageserve.prepare.openai_api.HttpServer


def build_prepare(args: argparse.Namespace) -> PrepareService:
    """Build prepare from its parsed flags and start listening (gRPC, and HTTP with ``--http-port``).

    Raises:
        OSError, ValueError, RuntimeError: a file that cannot be read (tokenizer, keys, certificates),
            a bad value, or a port that cannot be bound; the message says which.
    """
    from prometheus_client import CollectorRegistry

    from stageserve.metrics_http import start_metrics_server
    from stageserve.model_files import resolve_model_path
    from stageserve.prepare.limits import MAX_REQUEST_BYTES
    from stageserve.prepare.metrics import PrepareMetrics
    from stageserve.prepare.sampling_defaults import load_sampling_defaults
    from stageserve.prepare.service import SERVICE_NAME
    from stageserve.process_memory import return_freed_memory
    from stageserve.security.config import ServiceSecurity
    from stageserve.server import AioServiceServer, profile_dir
    from stageserve.tokenizer import load_tokenizer
    from stageserve.tracing import Tracer

    tracer = Tracer("prepare")
    metrics = PrepareMetrics(CollectorRegistry())
    # Profiling reaches each --device entry (a dns:/// entry: the one pod its channel picks).
    profile_peers = {**{"device" if i == 0 else f"device {i + 1}": entry for i, entry in enumerate(args.device.entries)},
                     "reclaim": args.reclaim}
    security = ServiceSecurity.from_args(args, serves_internal=False)
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    return_freed_memory()  # what reading the tokenizer freed (~30 MiB for SmolLM2's)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    server = AioServiceServer(SERVICE_NAME, args.host, args.port, max_workers=args.max_workers, port_file=args.port_file,
                              tracer=tracer, profile_peers=profile_peers, thread_name="prepare-grpc", security=security,
                              max_receive_bytes=MAX_REQUEST_BYTES, profile_dir=profile_dir(args))
    start_metrics_server(metrics.registry, args.host, args.metrics_port, args.port_file)
    if args.trace_dir:
        tracer.start(args.trace_dir)
    return _serve_apis(args, server, tokenizer, load_sampling_defaults(model_path), tracer, metrics, security)


def _serve_apis(args: argparse.Namespace, server, tokenizer, sampling_defaults, tracer, metrics, security) -> PrepareService:
    """Wire the connector, router and frontend behind ``server``, start it and the HTTP API.

    Raises:
        RuntimeError: the HTTP port cannot be bound (the gRPC server is stopped again).
    """
    from stageserve.prepare.connector import PipelineConnector
    from stageserve.prepare.engine import Engine
    from stageserve.prepare.frontend import GenerationFrontend
    from stageserve.prepare.request_handle import LoopWaker
    from stageserve.prepare.router import DeviceRouter
    from stageserve.prepare.service import SERVICE_NAME, GenerationServicer
    from stageserve.prepare.tool_calls import pick_tool_call_parser
    from stageserve.v1 import prepare_pb2_grpc

    connector = PipelineConnector(
        args.device, args.reclaim,
        new_engine=lambda: Engine(max_prefill_chunk=args.max_prefill_chunk, max_waiting=args.max_waiting, tracer=tracer, metrics=metrics,
                                  enable_prefix_caching=args.prefix_caching,
                                  resume=lambda *orphans: router.resume(*orphans)),  # the router below
        on_ready=lambda up: server.set_ready(up and not router.draining),
        step_timeout_s=args.step_timeout,
        stall_timeout_s=args.stall_timeout,
        refresh_s=args.device_refresh_s,
        tls=security.tls,
    )
    router = DeviceRouter(connector.sessions, metrics, lambda: server.stop_requested)
    metrics.watch_engine(router.current_load)
    frontend = GenerationFrontend(router, tokenizer, LoopWaker(server.loop), tuple(args.served_model_name), sampling_defaults,
                                  share_prefix_cache=args.prefix_cache_sharing == "shared", tenant_limits=security.policy.keys.limits())
    tool_call_parser = pick_tool_call_parser(args.tool_call_parser, tokenizer.chat_template)
    server.add_servicer(prepare_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(frontend, args.reasoning_parser, tool_call_parser))
    server.start([SERVICE_NAME])
    try:
        http = _start_http(args, frontend, server.loop, security, tool_call_parser)
    except RuntimeError:
        server.stop(0)
        raise
    return PrepareService(server, connector, router, http)


def _start_http(args: argparse.Namespace, frontend, loop, security, tool_call_parser: str):
    """The OpenAI-compatible HTTP server when ``--http-port`` is set, else ``None``. Raises RuntimeError (cannot bind)."""
    if args.http_port is None:
        return None
    from stageserve.prepare.openai_api import HttpServer, create_app

    tls = security.tls if security.tls is not None and security.tls.serves_tls else None
    app = create_app(frontend, security.policy, tool_call_parser, args.reasoning_parser)
    http = HttpServer(app, args.host, args.http_port, loop, args.port_file, tls=tls)
    log.info("OpenAI-compatible API on %s://%s:%d/v1 (%s)", "https" if tls else "http", args.host, http.port, security.describe())
    return http
