"""``stageserve prepare``: the public Generation API, validation and the continuous-batching scheduler.

Dials reclaim (``--reclaim``) and every device service (``--device``: a list, or a ``dns:///``
name re-resolved every ``--device-refresh-s``), keeps reconnecting with backoff, and places each
request on one device (``router.py``). Readiness is SERVING while reclaim is subscribed and at least
one device takes requests. The public API is served on ``grpc.aio``: one event loop on the thread
``prepare-grpc``, one coroutine per RPC; the scheduler and the links keep their threads. SIGTERM:
readiness NOT_SERVING, new requests refused with ``UNAVAILABLE`` ("server is draining"), in-flight
requests complete for up to ``--drain-timeout`` seconds, exit 0. ``--http-port`` also serves the
OpenAI-compatible HTTP API (``openai_api.py``) on the same event loop, through the same frontend.
Security (``stageserve.security``): ``--api-keys-file`` / ``--admin-keys-file`` make both APIs
need a key (each key's request ids its own); ``--tls-cert``/``--tls-key`` serve TLS on gRPC and
HTTP, and with ``--tls-ca`` the device and reclaim are dialled over mutual TLS.
"""

from __future__ import annotations

import argparse
import logging

from stageserve.device_endpoints import add_device_arguments
from stageserve.security.config import add_key_arguments
from stageserve.server import add_service_arguments

log = logging.getLogger("stageserve.prepare")

SERVICE_NAME = "stageserve.v1.Generation"
DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prepare service's command-line flags."""
    add_service_arguments(parser, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    add_device_arguments(parser, "127.0.0.1:50052")
    add_key_arguments(parser)
    parser.add_argument("--reclaim", default="127.0.0.1:50053", metavar="HOST:PORT", help="the reclaim service (default: %(default)s)")
    parser.add_argument("--model", default="", metavar="PATH",
                        help="tokenizer source: a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-waiting", type=_positive_int, default=256,
                        help="requests waiting for admission per device at most; more are refused with RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-prefill-chunk", type=_positive_int, default=512, metavar="TOKENS",
                        help="prompt tokens of one sequence per step at most (chunked prefill; default: %(default)s)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="prefill every prompt in full: no KV blocks shared between requests (default: a prompt starts at"
                             " its longest cached prefix of full blocks)")
    parser.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a step not published by reclaim within this time ends that device's session: its requests fail "
                             "with UNAVAILABLE (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a step not published within this time marks its device stalled: no new requests go to it "
                             "(UNAVAILABLE naming it when no other device accepts; readiness NOT_SERVING) until it completes "
                             "steps again (default: %(default)s)")
    parser.add_argument("--max-workers", type=_positive_int, default=16,
                        help="threads for work kept off the gRPC event loop: prompt validation and tokenization, "
                             "the Admin RPCs; streams need none (default: %(default)s)")
    parser.add_argument("--http-port", type=_port_or_off, default=None, metavar="PORT",
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
                             "on this port; 0 = ephemeral, written to <port-file>.http-port (default: off)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT/SIGHUP; return the exit code (0 after a clean drain)."""
    from prometheus_client import CollectorRegistry

    from stageserve.metrics_http import start_metrics_server
    from stageserve.model_files import resolve_model_path
    from stageserve.prepare.service import GenerationServicer
    from stageserve.prepare.frontend import GenerationFrontend
    from stageserve.prepare.connector import PipelineConnector
    from stageserve.prepare.engine import Engine
    from stageserve.prepare.limits import MAX_REQUEST_BYTES
    from stageserve.prepare.metrics import PrepareMetrics
    from stageserve.prepare.request_handle import LoopWaker
    from stageserve.prepare.router import DeviceRouter
    from stageserve.security.config import ServiceSecurity
    from stageserve.server import AioServiceServer, configure_logging, profile_dir
    from stageserve.tokenizer import load_tokenizer
    from stageserve.tracing import Tracer
    from stageserve.v1 import prepare_pb2_grpc

    configure_logging(args.log_level, args.log_format, "prepare")
    tracer = Tracer("prepare")
    metrics = PrepareMetrics(CollectorRegistry())
    # Profiling reaches each --device entry (a dns:/// entry: the one pod its channel picks).
    profile_peers = {**{"device" if i == 0 else f"device {i + 1}": entry for i, entry in enumerate(args.device.entries)},
                     "reclaim": args.reclaim}
    try:
        security = ServiceSecurity.from_args(args, serves_internal=False)
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        server = AioServiceServer(SERVICE_NAME, args.host, args.port, max_workers=args.max_workers, port_file=args.port_file,
                                  tracer=tracer, profile_peers=profile_peers, thread_name="prepare-grpc", security=security,
                                  max_receive_bytes=MAX_REQUEST_BYTES, profile_dir=profile_dir(args))
        start_metrics_server(metrics.registry, args.host, args.metrics_port, args.port_file)
        if args.trace_dir:
            tracer.start(args.trace_dir)
    except (OSError, ValueError, RuntimeError) as exc:  # FileNotFoundError is an OSError
        log.error("%s", exc)
        return 2
    connector = PipelineConnector(
        args.device, args.reclaim,
        new_engine=lambda: Engine(max_prefill_chunk=args.max_prefill_chunk, max_waiting=args.max_waiting, tracer=tracer, metrics=metrics,
                                  enable_prefix_caching=args.prefix_caching),
        on_ready=lambda up: server.set_ready(up and not router.draining),
        step_timeout_s=args.step_timeout,
        stall_timeout_s=args.stall_timeout,
        refresh_s=args.device_refresh_s,
        tls=security.tls,
    )
    router = DeviceRouter(connector.sessions, metrics)
    metrics.watch_engine(router.current_load)
    frontend = GenerationFrontend(router, tokenizer, LoopWaker(server.loop))
    server.add_servicer(prepare_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(frontend))
    server.start([SERVICE_NAME])
    try:
        http = _start_http(args, frontend, server.loop, security)
    except RuntimeError as exc:
        log.error("%s", exc)
        server.stop(0)
        return 2
    connector.start()

    def drain() -> None:
        router.drain(args.drain_timeout)
        if http is not None:
            http.stop(timeout_s=1.0)  # its requests have ended (or failed) with the drain
        connector.stop()

    server.run_until_stopped(drain)
    return 0


def _start_http(args: argparse.Namespace, frontend, loop, security):
    """The OpenAI-compatible HTTP server when ``--http-port`` is set, else ``None``. Raises RuntimeError (cannot bind)."""
    if args.http_port is None:
        return None
    from stageserve.prepare.openai_api import HttpServer, create_app

    tls = security.tls if security.tls is not None and security.tls.serves_tls else None
    http = HttpServer(create_app(frontend, security.policy), args.host, args.http_port, loop, args.port_file, tls=tls)
    log.info("OpenAI-compatible API on %s://%s:%d/v1 (%s)", "https" if tls else "http", args.host, http.port, security.describe())
    return http


def _port_or_off(text: str) -> int | None:
    if text == "off":
        return None
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] or off, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
