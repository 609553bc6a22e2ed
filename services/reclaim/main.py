"""``stageserve reclaim``: command line of the reclaim service (completion, detokenize, stops, publish).

Heavy imports (transformers, via the service module) happen in :func:`run`, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging

from stageserve.device_endpoints import add_device_arguments
from stageserve.model_files import resolve_model_path
from stageserve.security.config import ServiceSecurity
from stageserve.server import add_service_arguments, configure_logging, profile_dir

log = logging.getLogger(__name__)

DEFAULT_PORT = 50053
DEFAULT_METRICS_PORT = 9103


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the reclaim service's flags to ``parser``."""
    add_service_arguments(parser, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    add_device_arguments(parser, "127.0.0.1:50052")
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory whose tokenizer to use (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--completion-timeout", type=float, default=30.0, metavar="SECONDS", help="fail a step whose output does not arrive within this long after its ticket (default %(default)s)")
    parser.add_argument("--subscriber-queue-steps", type=int, default=1024, metavar="STEPS", help="steps a subscriber may lag behind before it is dropped (default %(default)s)")
    parser.add_argument("--max-subscribers", type=int, default=16, metavar="N",
                        help="Subscribe streams at once at most (prepare replicas and observers); more get RESOURCE_EXHAUSTED (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run the reclaim service; return the exit code (0 after SIGTERM and drain, 2 on a bad flag)."""
    configure_logging(args.log_level, args.log_format, "reclaim")
    if args.completion_timeout <= 0 or args.drain_timeout < 0 or args.subscriber_queue_steps < 1 or args.max_subscribers < 1:
        log.error("--completion-timeout must be > 0, --drain-timeout >= 0, --subscriber-queue-steps and --max-subscribers >= 1")
        return 2
    try:
        model_path = resolve_model_path(args.model)
        security = ServiceSecurity.from_args(args, serves_internal=True)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    from stageserve.reclaim.service import serve  # imports transformers

    return serve(
        device=args.device,
        device_refresh_s=args.device_refresh_s,
        model_path=model_path,
        completion_timeout_s=args.completion_timeout,
        host=args.host,
        port=args.port,
        port_file=args.port_file,
        drain_timeout_s=args.drain_timeout,
        subscriber_queue_steps=args.subscriber_queue_steps,
        metrics_port=args.metrics_port,
        trace_dir=args.trace_dir,
        security=security,
        profile_dir=profile_dir(args),
        max_subscribers=args.max_subscribers,
    )
