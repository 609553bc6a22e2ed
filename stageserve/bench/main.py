"""``stageserve bench``: the load generator, and the comparison runs as sub-commands.

``stageserve bench --target HOST:PORT --streams 32 --requests 64`` loads a running prepare service
and prints a table (and ``--json FILE`` the report; ``--json -`` prints only the JSON on stdout and
the table on stderr). The exit code is 1 when any request failed. The comparisons start what they compare
themselves, on the embedded model unless ``--model`` says otherwise:

- ``stageserve bench compare-dispatch``: async versus sync dispatch (sim device and real model);
- ``stageserve bench compare-split``: three services versus the same code in one process;
- ``stageserve bench compare-peers``: versus transformers and llama-cpp-python (``stageserve[bench]``);
- ``stageserve bench compare-weights``: quantized against bfloat16 weights against llama.cpp's ``llama-server``;
- ``stageserve bench sweep``: tokens/s and p99 ITL against concurrency, with a PNG plot;
- ``stageserve bench compare-prefix-cache``: prefix caching on against off (shared system prompt,
  multi-turn chat against llama-server too, no shared prefix);
- ``stageserve bench compare-structured``: every request constrained by a JSON schema against the
  same prompts unconstrained, plus the time to compile a new and a cached schema;
- ``stageserve bench compare-speculative``: n-gram (with ``--draft-model``: and draft-model)
  speculative decoding against none (input-grounded and open-ended workloads): tokens/s, ITL,
  acceptance per position.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from stageserve.device.flags import SPECULATIVE_POLICIES, WEIGHT_FORMATS

LLAMA_SERVER_HELP = "the llama-server program (default: llama-server on PATH; without one, stageserve's sides only)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load generator's flags, plus one sub-command per comparison."""
    _add_workload_arguments(parser)
    parser.add_argument("--target", default="127.0.0.1:50051", help="prepare's address (default %(default)s)")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="PEM", help="--target serves TLS: trust this CA bundle")
    parser.add_argument("--api-key", default=os.environ.get("STAGESERVE_API_KEY", ""),
                        help="API key sent to --target as 'authorization: Bearer KEY' (default: $STAGESERVE_API_KEY)")
    parser.add_argument("--openai", default=None, metavar="URL",
                        help="send the load to prepare's OpenAI-compatible API at URL (http://HOST:PORT/v1) instead of gRPC; "
                             "--target still tokenizes for --input-len")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--streams", type=int, default=None, metavar="N", help="N concurrent streams (default 8 unless --rate)")
    load.add_argument("--rate", type=float, default=None, metavar="R", help="Poisson arrivals, R requests/s")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="with --rate: N requests in flight at most")
    parser.add_argument("--requests", type=int, default=None, metavar="N", help="send N requests (default 64 unless --duration)")
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS", help="stop sending after SECONDS; in-flight requests finish")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                        help="JSONL prompts: one of \"messages\", \"prompt\" or \"prompt_token_ids\" per line (default: the built-in set)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="also write the report as JSON; - = to stdout, with the table on stderr")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sub = parser.add_subparsers(dest="comparison", metavar="COMPARISON", help="run a comparison instead of loading --target")
    dispatch = _comparison(sub, "compare-dispatch", "async versus sync dispatch: step period, tokens/s, period / max stage time")
    dispatch.add_argument("--sim-step-ms", type=float, nargs="*", default=[2.0, 5.0, 20.0], metavar="MS",
                          help="simulated step times (default 2 5 20; none: only the real model)")
    dispatch.add_argument("--streams", type=int, default=32, dest="compare_streams", help="concurrent streams (default %(default)s)")
    dispatch.add_argument("--no-model", action="store_true", help="only the simulated device")
    split = _comparison(sub, "compare-split", "three services versus the same code in one process: TTFT, ITL, tokens/s")
    split.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], dest="compare_streams", help="stream counts (default 1 8 32)")
    peers = _comparison(sub, "compare-peers", "versus transformers (static batch) and llama-cpp-python (one at a time)")
    peers.add_argument("--streams", type=int, default=32, dest="compare_streams", help="concurrent streams (default %(default)s)")
    weights = _comparison(sub, "compare-weights", "quantized against bfloat16 weights against llama.cpp's llama-server: ITL, tokens/s, memory")
    weights.add_argument("--streams", type=int, default=32, dest="compare_streams", help="concurrent streams besides 1 (default %(default)s; llama-server gets --parallel N)")
    weights.add_argument("--llama-server", type=Path, default=None, metavar="PATH", help=LLAMA_SERVER_HELP)
    weights.add_argument("--weights", nargs="+", default=["auto", "dequantize"], dest="compare_weights", help="stageserve device --weights values to run, each optionally with more device flags for that side "
                         "('auto --dense-copy all'; default auto dequantize)")
    sweep = _comparison(sub, "sweep", "tokens/s and p99 ITL against concurrency for stageserve and the peers, with a PNG plot")
    sweep.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], dest="compare_streams", help="concurrency values (default 1..64)")
    sweep.add_argument("--llama-max-requests", type=int, default=4, metavar="N",
                       help="llama-cpp-python serves one request at a time, so its figures do not depend on concurrency: time at most N requests (default %(default)s)")
    prefix = _comparison(sub, "compare-prefix-cache", "prefix caching on against off: shared system prompt, multi-turn chat, no shared prefix")
    prefix.add_argument("--streams", type=int, default=16, dest="compare_streams", help="concurrent streams of the loaded runs (default %(default)s)")
    prefix.add_argument("--system-tokens", type=int, default=1500, metavar="TOKENS", help="shared system prompt length (default %(default)s)")
    prefix.add_argument("--llama-server", type=Path, default=None, metavar="PATH", help=LLAMA_SERVER_HELP + " (the multi-turn chat)")
    structured = _comparison(sub, "compare-structured", "JSON-schema constrained against unconstrained requests: tokens/s, step period, compile time")
    structured.add_argument("--streams", type=int, default=32, dest="compare_streams", help="concurrent streams (default %(default)s)")
    structured.add_argument("--json-schema", type=Path, default=None, dest="compare_schema", metavar="FILE",
                            help="the constrained side's JSON schema (default: a mid-sized record schema repeated beyond --output-len)")
    spec = _comparison(sub, "compare-speculative", "n-gram (and draft-model) speculative decoding against none: tokens/s, ITL p50, acceptance rate")
    spec.add_argument("--streams", type=int, nargs="+", default=[1, 8], dest="compare_streams", help="stream counts (default 1 8)")
    spec.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[3, 5], metavar="K", help="K values to run (default 3 5)")
    spec.add_argument("--draft-model", type=Path, default=None, metavar="PATH",
                      help="also run --speculative-method draft with this draft model (GGUF or Hugging Face directory sharing --model's tokenizer) at each K")
    spec.add_argument("--llama-server", type=Path, default=None, metavar="PATH",
                      help=LLAMA_SERVER_HELP + " (without and with its --spec-type ngram-simple at each K)")
    spec.add_argument("--speculative-policy", nargs="+", default=["goodput"], choices=SPECULATIVE_POLICIES, dest="speculative_policies",
                      help="run each speculating side with each of these device --speculative-policy values (default goodput)")
    spec.add_argument("--weights", default="auto", choices=WEIGHT_FORMATS, dest="spec_weights",
                      help="stageserve device --weights of every stageserve side (default auto; dequantize: every weight in --dtype)")
    sweep.add_argument("--plot", type=Path, default=Path("docs/benchmarks-concurrency.png"), help="PNG path (default %(default)s)")


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-len", type=int, default=128, metavar="TOKENS", help="max_tokens of each request (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=None, metavar="TOKENS", help="cut or repeat each prompt to TOKENS tokens (default: as written)")
    parser.add_argument("--len-spread", type=float, default=0.0, metavar="F", help="draw lengths uniformly within +-F of the given ones (default 0: fixed)")
    parser.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS (lengths then vary)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="prompt order, length draws and arrival gaps (default %(default)s)")
    parser.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                        help="constrain every request's output to the JSON schema in FILE (structured output; needs --no-ignore-eos)")


def _comparison(sub, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="real-model dtype (default %(default)s)")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "npu"], help="where the real model runs (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side; figures are medians (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=128, dest="compare_output_len", metavar="TOKENS", help="output tokens per request (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=64, dest="compare_input_len", metavar="TOKENS", help="prompt tokens per request (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, dest="compare_seed")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for the raw JSON (default %(default)s)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the load generator or the chosen comparison; 0 on success, 1 if requests failed, 2 on bad flags."""
    import os
    import signal

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a comparison's finally blocks then stop the servers it started
    try:
        if args.comparison:
            print(_run_comparison(args))
            return 0
        return _run_load(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _exit_on_sigterm(_signum, _frame) -> None:
    raise SystemExit(143)


def _run_load(args: argparse.Namespace) -> int:
    import asyncio

    from stageserve.bench.loadgen import Load, grpc_tokenizer, run_load
    from stageserve.bench.metrics import build_report, format_table
    from stageserve.bench.workload import Shape, Workload, load_prompts

    shape = Shape(output_len=args.output_len, input_len=args.input_len, spread=args.len_spread,
                  ignore_eos=not args.no_ignore_eos, temperature=args.temperature, constraint=_constraint(args.json_schema))
    workload = Workload(load_prompts(args.prompts), shape, args.seed, grpc_tokenizer(args.target, args.tls_ca, args.api_key) if args.input_len else None)
    streams = args.streams if args.streams is not None or args.rate is not None else 8
    requests = args.requests if args.requests is not None or args.duration is not None else 64
    load = Load(streams=streams, rate=args.rate, max_concurrency=args.max_concurrency, requests=requests, duration_s=args.duration, seed=args.seed)
    records = asyncio.run(run_load(lambda: _transport(args), workload, load, not args.no_progress))
    config = {"target": args.openai or args.target, "streams": load.streams, "rate": load.rate, "max_concurrency": load.max_concurrency,
              "requests": load.requests, "duration_s": load.duration_s, "prompts": str(args.prompts) if args.prompts else "built-in",
              "output_len": shape.output_len, "input_len": shape.input_len, "spread": shape.spread,
              "ignore_eos": shape.ignore_eos, "temperature": shape.temperature, "seed": args.seed,
              "json_schema": str(args.json_schema) if args.json_schema else None}
    report = build_report(records, config)
    json_to_stdout = args.json is not None and str(args.json) == "-"
    print(format_table(report), file=sys.stderr if json_to_stdout else sys.stdout)  # stdout stays pure JSON
    if args.json is not None:
        text = json.dumps(report, indent=1)
        if json_to_stdout:
            print(text)
        else:
            args.json.write_text(text + "\n")
    requests = report["requests"]
    if requests["sent"] and not requests["ok"]:
        errors = ", ".join(f"{code} {n}" for code, n in report["errors"].items())
        print(f"error: every request failed ({errors}); is prepare running and ready at {args.target}?", file=sys.stderr)
    return 0 if requests["failed"] == 0 else 1


def _constraint(schema_path: Path | None):
    """The ``Constraint`` of the JSON schema in ``schema_path``, or ``None``. Raises ValueError: not JSON."""
    if schema_path is None:
        return None
    from stageserve.v1 import common_pb2

    return common_pb2.Constraint(json_schema=json.dumps(_read_schema(schema_path)))


def _read_schema(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--json-schema {path}: not JSON ({exc})") from None


def _transport(args: argparse.Namespace):
    if args.openai:
        from stageserve.bench.openai_transport import OpenAITransport

        return OpenAITransport(args.openai)
    from stageserve.bench.loadgen import GrpcTransport

    return GrpcTransport(args.target, args.tls_ca, args.api_key)


def llama_server_program(given: Path | None) -> Path | None:
    """``--llama-server``, else ``llama-server`` on PATH, else ``None`` (said on stderr: the comparison runs without it)."""
    import shutil

    binary = given or shutil.which("llama-server")
    if binary is None:
        print("no llama-server on PATH (give --llama-server PATH): comparing stageserve's sides only", file=sys.stderr)
    return None if binary is None else Path(binary)


def _run_comparison(args: argparse.Namespace) -> str:
    from stageserve.bench import compare
    from stageserve.model_files import resolve_model_path

    common = compare.Common(
        model_path=resolve_model_path(args.model), dtype=args.dtype, backend=args.backend, repeats=args.repeats, output_len=args.compare_output_len,
        input_len=args.compare_input_len, seed=args.compare_seed, out_dir=args.out, progress=not args.no_progress,
    )
    if args.comparison == "compare-dispatch":
        return compare.compare_dispatch(common, args.sim_step_ms, args.compare_streams, include_model=not args.no_model)
    if args.comparison == "compare-split":
        return compare.compare_split(common, args.compare_streams)
    if args.comparison == "compare-prefix-cache":
        from stageserve.bench.prefix_cache import compare_prefix_cache

        return compare_prefix_cache(common, args.compare_streams, args.system_tokens, llama_server=llama_server_program(args.llama_server))
    if args.comparison == "compare-structured":
        from stageserve.bench.structured import compare_structured

        return compare_structured(common, args.compare_streams, _read_schema(args.compare_schema) if args.compare_schema else None)
    if args.comparison == "compare-speculative":
        from stageserve.bench.compare_speculative import compare_speculative

        return compare_speculative(common, args.compare_streams, args.num_speculative_tokens, args.draft_model,
                                   llama_server_program(args.llama_server), args.speculative_policies, args.spec_weights)
    if args.comparison == "compare-peers":
        return compare.compare_peers(common, args.compare_streams)
    if args.comparison == "compare-weights":
        from stageserve.bench.compare_weights import compare_weights

        return compare_weights(common, llama_server_program(args.llama_server), args.compare_streams, args.compare_weights)
    return compare.sweep(common, args.compare_streams, args.llama_max_requests, args.plot)
