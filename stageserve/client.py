"""``stageserve generate``: a small client that streams a generation to the terminal.

Prints text as it arrives on stdout, then usage and timing on stderr: time to first token (TTFT),
mean inter-token latency (ITL) and tokens/s. An ``UNAVAILABLE`` call (a draining or lost prepare
replica; or ``CANCELLED`` by a server stopping as it arrived), even one broken mid-stream, is retried from the start after the status's RetryInfo delay,
printing only the text not printed yet (:mod:`stageserve.retrying`; a sampled request without
``--seed`` gets a random seed, so that the retry reproduces it). ``--target`` may name several
replicas (``ipv4:HOST:PORT,HOST:PORT``), used round robin. On any other gRPC error it prints the
status code name and message and exits with 1. ``--tls-ca`` connects over TLS (trusting that CA);
``--api-key`` (or the ``STAGESERVE_API_KEY`` environment variable) is sent as
``authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc

from stageserve.retrying import RetryDiverged, reproducible, stream_generation
from stageserve.security.tls import TlsFiles, dial
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default="", help="raw prompt text (no chat template)")
    parser.add_argument("--chat", default="", help="a user chat message, rendered with the model's chat template")
    parser.add_argument("--target", default="127.0.0.1:50051",
                        help="prepare's address (HOST:PORT), or a gRPC target naming several replicas (ipv4:HOST:PORT,HOST:PORT)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="default 1.0; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=_seed, default=None, help="0 to 2**64-1; same seed + prompt = same text")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="PEM", help="connect over TLS, trusting this CA bundle")
    parser.add_argument("--api-key", default=os.environ.get("STAGESERVE_API_KEY", ""),
                        help="API key, sent as 'authorization: Bearer KEY' (default: $STAGESERVE_API_KEY)")


def open_channel(target: str, tls_ca: Path | None = None) -> grpc.Channel:
    """A channel to prepare: TLS trusting ``tls_ca`` when given, else plaintext; calls go round robin
    over the addresses ``target`` resolves to (several replicas: a lost one is skipped)."""
    return dial(target, TlsFiles(None, None, tls_ca) if tls_ca else None, options=[("grpc.lb_policy_name", "round_robin")])


def key_metadata(api_key: str) -> list[tuple[str, str]] | None:
    """The call metadata that carries ``api_key`` (``None`` without one)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"--seed must be in [0, 2**64), got {text}")
    return value


def build_request(args: argparse.Namespace) -> prepare_pb2.GenerateRequest:
    """The GenerateRequest for the command-line flags (only the flags given are set)."""
    request = prepare_pb2.GenerateRequest(top_k=args.top_k, stop=args.stop)
    if args.chat:
        request.messages.append(prepare_pb2.ChatMessage(role="user", content=args.chat))
    else:
        request.prompt = args.prompt
    for field in ("max_tokens", "temperature", "top_p", "seed"):
        value = getattr(args, field)
        if value is not None:
            setattr(request, field, value)
    return request


def stream(target: str, request: prepare_pb2.GenerateRequest, timeout_s: float | None = None, tls_ca: Path | None = None,
           api_key: str = "") -> int:
    """Stream ``request`` to stdout, retrying ``UNAVAILABLE`` and a stopping server's ``CANCELLED`` (module docstring); print usage and
    timing to stderr, and each retry. Returns the exit code."""
    start = time.perf_counter()
    arrivals: list[float] = []
    last = None
    with open_channel(target, tls_ca) as channel:
        stub = prepare_pb2_grpc.GenerationStub(channel)
        try:
            for chunk in stream_generation(stub, reproducible(request), timeout_s, key_metadata(api_key), on_retry=_tell_retry):
                now = time.perf_counter()
                arrivals.extend([now] * len(chunk.token_ids))
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except RetryDiverged as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            return 1
    print(flush=True)
    if last is not None:
        reason = common_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
        ttft_ms = (arrivals[0] - start) * 1e3 if arrivals else float("nan")
        itl_ms = (arrivals[-1] - arrivals[0]) * 1e3 / (len(arrivals) - 1) if len(arrivals) > 1 else float("nan")
        elapsed = time.perf_counter() - start
        print(
            f"[finish={reason} prompt_tokens={last.usage.prompt_tokens} completion_tokens={last.usage.completion_tokens} "
            f"ttft={ttft_ms:.1f} ms itl={itl_ms:.1f} ms {last.usage.completion_tokens / elapsed:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0


def _tell_retry(error: grpc.RpcError, delay_s: float) -> None:
    print(f"\n[{error.code().name}: {error.details()}; retrying in {delay_s:.1f} s]", file=sys.stderr, flush=True)


def stream_chat(target: str, message: str, tls_ca: Path | None = None, api_key: str = "") -> int:
    """Stream a greedy chat answer to one user message (what ``make run`` shows)."""
    request = prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content=message)], temperature=0.0)
    return stream(target, request, tls_ca=tls_ca, api_key=api_key)


def run(args: argparse.Namespace) -> int:
    if bool(args.prompt) == bool(args.chat):
        print("error: give either a prompt or --chat TEXT (one of them)", file=sys.stderr)
        return 2
    return stream(args.target, build_request(args), args.timeout, args.tls_ca, args.api_key)
