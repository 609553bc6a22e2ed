"""``stageserve prepare``: the public Generation API, validation and the continuous-batching scheduler.

Dials the device (``--device``) and reclaim (``--reclaim``) and keeps reconnecting with backoff;
readiness is SERVING only while both are connected. SIGTERM: readiness NOT_SERVING, new requests
refused with ``UNAVAILABLE`` ("server is draining"), in-flight requests complete for up to
``--drain-timeout`` seconds, exit 0.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger("stageserve.prepare")

SERVICE_NAME = "stageserve.v1.Generation"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The prepare service's command-line flags."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50051, help="port of the public API; 0 = ephemeral (default: %(default)s)")
    parser.add_argument("--port-file", type=Path, help="write the bound port to this file once listening")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long in-flight requests may run before they fail (default: %(default)s)")
    parser.add_argument("--device", default="127.0.0.1:50052", metavar="HOST:PORT", help="the device service (default: %(default)s)")
    parser.add_argument("--reclaim", default="127.0.0.1:50053", metavar="HOST:PORT", help="the reclaim service (default: %(default)s)")
    parser.add_argument("--model", default="", metavar="PATH",
                        help="tokenizer source: a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--max-waiting", type=_positive_int, default=256,
                        help="requests waiting for admission at most; more are refused with RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-prefill-chunk", type=_positive_int, default=512, metavar="TOKENS",
                        help="prompt tokens of one sequence per step at most (chunked prefill; default: %(default)s)")
    parser.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a step not published by reclaim within this time ends the session (default: %(default)s)")
    parser.add_argument("--max-workers", type=_positive_int, default=320,
                        help="RPC handler threads; each open stream holds one (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code (0 after a clean drain)."""
    from stageserve.model_files import resolve_model_path
    from stageserve.prepare.api import GenerationServicer
    from stageserve.prepare.engine import Engine
    from stageserve.prepare.links import PipelineConnector
    from stageserve.server import ServiceServer, configure_logging
    from stageserve.tokenizer import load_tokenizer
    from stageserve.v1 import prepare_pb2_grpc

    configure_logging(args.log_level)
    try:
        tokenizer = load_tokenizer(resolve_model_path(args.model))
        server = ServiceServer(SERVICE_NAME, args.host, args.port, max_workers=args.max_workers, port_file=args.port_file)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        log.error("%s", exc)
        return 2
    engine = Engine(max_prefill_chunk=args.max_prefill_chunk, max_waiting=args.max_waiting)
    engine.start()
    server.add_servicer(prepare_pb2_grpc.add_GenerationServicer_to_server, GenerationServicer(engine, tokenizer))
    server.start([SERVICE_NAME])
    connector = PipelineConnector(
        args.device, args.reclaim, engine,
        on_ready=lambda up: server.set_ready(up and not engine.draining),
        step_timeout_s=args.step_timeout,
    )
    connector.start()

    def drain() -> None:
        engine.drain(args.drain_timeout)
        connector.stop()
        engine.stop()

    server.run_until_stopped(drain)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
