"""The prepare service's command-line flags (torch-free: ``stageserve up`` and ``--help`` import it cheaply)."""

from __future__ import annotations

import argparse

from stageserve.device_endpoints import add_device_arguments
from stageserve.prepare.openai_flags import add_openai_arguments
from stageserve.security.config import add_key_arguments
from stageserve.server import add_service_arguments

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9101
PREFIX_CACHE_SHARING = ("per-key", "shared")


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
    parser.add_argument("--prefix-cache-sharing", choices=PREFIX_CACHE_SHARING, default="per-key",
                        help="with --api-keys-file: per-key = a key's requests reuse only that key's cached blocks (a hit"
                             " would tell one tenant what another sent); shared = every key's requests share them, for"
                             " tenants that trust each other (default: %(default)s; without keys the cache is shared)")
    parser.add_argument("--step-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="a step not published by reclaim within this time ends that device's session: its requests fail "
                             "with UNAVAILABLE (default: %(default)s)")
    parser.add_argument("--stall-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="a step not published within this time, from a device that does not answer a health Check "
                             "within it either (a slow device answers), marks the device stalled: no new requests go to it "
                             "(UNAVAILABLE naming it when no other device accepts; readiness NOT_SERVING) until it completes "
                             "steps again or answers (default: %(default)s)")
    parser.add_argument("--max-workers", type=_positive_int, default=16,
                        help="threads for work kept off the gRPC event loop: prompt validation and tokenization, "
                             "the Admin RPCs; streams need none (default: %(default)s)")
    parser.add_argument("--http-port", type=_port_or_off, default=None, metavar="PORT",
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models) "
                             "on this port; 0 = ephemeral, written to <port-file>.http-port (default: off)")
    add_openai_arguments(parser)


def _port_or_off(text: str) -> int | None:
    """``--http-port``: a port number, or ``off`` (``None``)."""
    if text == "off":
        return None
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535] or off, got {value}")
    return value


def _positive_int(text: str) -> int:
    """An integer of at least 1 (argparse type)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
