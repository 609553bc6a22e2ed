"""The reclaim service's command-line flags and their checks (light: ``--help`` and ``stageserve up`` import it cheaply)."""

from __future__ import annotations

import argparse

from stageserve.device_endpoints import add_device_arguments
from stageserve.server import add_service_arguments

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


def check_flags(args: argparse.Namespace) -> str | None:
    """What is wrong with the parsed flags (one message naming them), ``None`` when they are valid."""
    if args.completion_timeout <= 0 or args.drain_timeout < 0 or args.subscriber_queue_steps < 1 or args.max_subscribers < 1:
        return "--completion-timeout must be > 0, --drain-timeout >= 0, --subscriber-queue-steps and --max-subscribers >= 1"
    return None
