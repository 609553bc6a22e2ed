"""``stageserve device``: command line and start-up of the device service (model, KV cache, executor).

Start-up order: listen (readiness NOT_SERVING) → load the weights → size and allocate the KV pool
→ run ONE warm-up step through the executor → readiness SERVING. torch is imported inside
:func:`run`, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import re
import time
import uuid
from pathlib import Path

from stageserve.model_files import EMBEDDED_MODEL_NAME, resolve_model_path
from stageserve.security.config import ServiceSecurity
from stageserve.server import add_service_arguments, configure_logging, profile_dir

log = logging.getLogger(__name__)

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("auto", "dequantize", "int8", "int4")  # the same as stageserve.device.kernels.quant.WEIGHT_FORMATS, which imports torch
# ngram: stageserve.device.speculation.proposer.PROPOSERS; draft: stageserve.device.speculation.draft_model (both import torch)
PROPOSER_NAMES = ("ngram", "draft")
SPECULATIVE_POLICIES = ("goodput", "always")  # --speculative-policy (docs/speculative.md#which-rows-draft)
CPU_DEFAULT_KV_BYTES = 512 * 1024**2
ACCELERATOR_DEFAULT_KV_FRACTION = 0.85
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as ``536870912``, ``512MiB``, ``2GiB`` or ``1.5GB`` (KiB = 1024, KB = 1000).

    Raises:
        argparse.ArgumentTypeError: not a positive size with a known unit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes; write e.g. 536870912, 512MiB or 2GiB")
    return int(float(match.group(1)) * unit)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the device service's flags to ``parser``."""
    add_service_arguments(parser, DEFAULT_PORT, DEFAULT_METRICS_PORT)
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and activations; auto = bfloat16 on cuda/npu and on CPUs with avx512_bf16 or amx_bf16, else float32")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="cpu backend: auto = a GGUF's Q4_0/Q4_1 linears on int4 kernels and Q8_0 on int8 ones, everything else in --dtype; "
                             "dequantize = every weight in --dtype; int8/int4 = every linear in that format (default %(default)s)")
    parser.add_argument("--backend", choices=("cpu", "cuda", "npu", "sim"), default="cpu",
                        help="where steps run; sim = simulated device: no weights, each step takes --sim-step-ms without computing (default %(default)s)")
    parser.add_argument("--sim-step-ms", type=float, default=5.0, metavar="MS", help="--backend sim: device time of every step (default %(default)s)")
    parser.add_argument("--sim-token-us", type=float, default=0.0, metavar="US", help="--backend sim: added device time per token a step carries (default %(default)s)")
    parser.add_argument("--no-dense-copy", action="store_true",
                        help="quantized weights: keep no dense copy for inputs of more rows than the quantized kernel takes (8, or 4 on torch's kernels), dequantize per call instead (least memory; steps of many rows run several times slower)")
    parser.add_argument("--dispatch", choices=("async", "sync"), default="async", help="async: submit without waiting; sync: wait each step before the next (for comparison)")
    spec = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    spec.add_argument("--speculative-method", choices=("none", *PROPOSER_NAMES), default="none",
                      help="ngram: prompt lookup, drafts copied from the sequence's own prompt and output; "
                           "draft: a smaller model (--draft-model) drafts greedily (default %(default)s)")
    spec.add_argument("--draft-model", default=None, metavar="PATH",
                      help="with --speculative-method draft: GGUF file or Hugging Face directory of a smaller model sharing --model's tokenizer, "
                           "loaded as --model is (--dtype, --weights); its KV pool shares the KV memory")
    spec.add_argument("--num-speculative-tokens", type=int, default=3, metavar="K", help="drafts per decode row and step at most, with a --speculative-method (default %(default)s)")
    spec.add_argument("--speculative-policy", choices=SPECULATIVE_POLICIES, default="goodput",
                      help="goodput: the device measures its step costs at start-up and prepare gives each decode row the drafts "
                           "expected to add the most tokens per second (none where they do not pay); always: every row asks for K "
                           "(default %(default)s)")
    parser.add_argument("--pipeline-depth", type=int, default=2, metavar="N", help="output slots = steps in flight at most (default %(default)s)")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES", help="KV pool size, e.g. 512MiB (default: 512MiB on cpu)")
    kv.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F", help=f"KV pool as this fraction of free device memory after loading (default on cuda/npu: {ACCELERATOR_DEFAULT_KV_FRACTION})")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="tokens per KV block (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="sequence table size = sequences in flight at most (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS", help="longest sequence (prompt + output) to accept (default: the model's context, capped by the KV pool)")
    parser.add_argument("--max-step-tokens", type=int, default=2048, metavar="TOKENS", help="tokens one step may carry (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch intra-op threads (default: cpu backend: the CPUs of the process's affinity and cgroup "
                             "quota, less a quarter CPU for its gRPC and completion threads, rounded; else torch's choice)")
    parser.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=True,
                        help="cpu backend: run on fewer of the --threads while other work holds the CPUs, on all again once it is gone "
                             "(default on; see docs/backends.md)")
    parser.add_argument("--no-cpu-kernels", action="store_true", help="cpu backend: run the layers in plain torch ops instead of the fused C++ kernels (for comparison)")
    parser.add_argument("--no-amx-linears", action="store_true",
                        help="cpu backend: keep decode-sized bf16 linears on oneDNN instead of AMX, which holds a second copy of the weights")


def run(args: argparse.Namespace) -> int:
    """Run the device service; return the exit code (0 after SIGTERM and drain, 2 on bad flags or model)."""
    configure_logging(args.log_level, args.log_format, "device")
    problem = _check_flags(args)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        model_path = resolve_model_path(args.model)
        security = ServiceSecurity.from_args(args, serves_internal=True)
    except (FileNotFoundError, ValueError) as exc:
        log.error("%s", exc)
        return 2

    if args.backend == "cpu" and args.threads is None:  # the CPUs it may use, not the host's (kernels/cpu_budget.py)
        from stageserve.device.kernels.cpu_budget import default_compute_threads

        args.threads = default_compute_threads()
    import torch  # noqa: F401 - heavy imports only past --help
    from prometheus_client import CollectorRegistry

    from stageserve.device import service
    from stageserve.device.metrics import DeviceMetrics
    from stageserve.metrics_http import start_metrics_server
    from stageserve.server import ServiceServer
    from stageserve.tracing import Tracer
    from stageserve.v1 import device_pb2_grpc

    # 1. Listen at once, NOT_SERVING, so orchestrators see a live process while the model loads.
    tracer = Tracer("device")
    metrics = DeviceMetrics(CollectorRegistry(), args.dispatch)
    try:
        server = ServiceServer(service.SERVICE_NAME, args.host, args.port, port_file=args.port_file, tracer=tracer, security=security,
                               profile_dir=profile_dir(args))
        start_metrics_server(metrics.registry, args.host, args.metrics_port, args.port_file)
    except (RuntimeError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    servicer = service.DeviceServicer()
    server.add_servicer(device_pb2_grpc.add_DeviceServicer_to_server, servicer)
    server.start([service.SERVICE_NAME])
    if args.backend != "cpu":
        core = _load(args, model_path, server, tracer, metrics)
        return core if isinstance(core, int) else _serve(args, server, servicer, tracer, metrics, core)
    # The cpu backend computes on this (the main) thread, where torch's OpenMP pool is fastest
    # (see `stageserve.device.backends`); loading, then serving and draining, run on helper threads.
    # Loading gets its own thread that ends before serving starts: a live thread that has run
    # torch's parallel ops keeps OpenMP workers, and with more OpenMP threads than cores libgomp's
    # idle workers sleep instead of spinning (measured: a 1-row step took 52 ms with the loading
    # thread alive, 37 ms without).
    from stageserve.device.backends import create_backend

    backend = create_backend("cpu", args.threads, on_caller=True, adaptive_threads=args.adaptive_threads)
    core = backend.serve_while(lambda: _load(args, model_path, server, tracer, metrics, backend))
    if isinstance(core, int):
        return core
    # Only now: a signal during loading keeps its default action and stops the process at once.
    server.handle_stop_signals()
    return backend.serve_while(lambda: _serve(args, server, servicer, tracer, metrics, core))


def _load(args: argparse.Namespace, model_path: Path, server, tracer, metrics, backend=None):
    """Load the model onto ``backend`` (made from the flags when ``None``), size the KV pool, warm up.

    Returns the `DeviceCore`, or the exit code 2 after logging why it could not be built.
    """
    from stageserve.device.model.config import ModelLoadError

    try:
        return build_core(args, model_path, tracer, metrics, backend)
    except (ModelLoadError, FileNotFoundError) as exc:
        log.error("cannot load the model: %s", exc)
    except RuntimeError as exc:  # device not available, KV pool does not fit, ...
        log.error("%s", exc)
    server.server.stop(0)
    return 2


def _serve(args: argparse.Namespace, server, servicer, tracer, metrics, core) -> int:
    """Serve ``core`` until SIGTERM/SIGINT/SIGHUP, drain, stop; the exit code."""
    # 3. Measure and trace from the first real step on (not the warm-up); serve until SIGTERM, then drain.
    metrics.start()
    if args.trace_dir:
        try:
            tracer.start(args.trace_dir)
        except OSError as exc:
            log.error("--trace-dir: %s", exc)
            server.server.stop(0)
            return 2
    servicer.serve(core)
    server.set_ready(True)
    reply = core.attach_reply
    metrics.describe_model(reply.model_name, reply.backend, reply.dtype)
    log.info("device ready: %s on %s (%s, %s dispatch, depth %d), %d KV blocks of %d tokens, instance %s",
             reply.model_name, reply.backend, reply.dtype, reply.dispatch, reply.pipeline_depth, reply.kv_num_blocks, reply.kv_block_size, reply.instance_id)

    def drain() -> None:
        # One deadline for all three waits: prepare lets go of this device once its requests ended
        # (it stops placing new ones here as soon as readiness turns NOT_SERVING), then the last
        # steps complete and reclaim takes their outputs.
        deadline = time.monotonic() + args.drain_timeout
        if (servicer.wait_execute_closed(args.drain_timeout)
                and core.executor.flush(max(0.0, deadline - time.monotonic()))
                and core.outbox.wait_empty(max(0.0, deadline - time.monotonic()))):
            servicer.end_complete_streams()
        else:
            log.warning("drain timeout (%g s): requests, steps or outputs still in flight", args.drain_timeout)

    server.run_until_stopped(drain)
    core.executor.close()
    return 0


def _check_flags(args: argparse.Namespace) -> str | None:
    """The first invalid flag value, as a message naming the flag; ``None`` if all are valid."""
    for flag, value, minimum in (("--pipeline-depth", args.pipeline_depth, 1), ("--block-size", args.block_size, 1),
                                 ("--max-num-seqs", args.max_num_seqs, 1), ("--max-step-tokens", args.max_step_tokens, 1)):
        if value < minimum:
            return f"{flag} must be at least {minimum}, got {value}"
    for flag, value in (("--threads", args.threads), ("--max-model-len", args.max_model_len)):
        if value is not None and value < 1:
            return f"{flag} must be at least 1, got {value}"
    for flag, value in (("--sim-step-ms", args.sim_step_ms), ("--sim-token-us", args.sim_token_us)):
        if value < 0:
            return f"{flag} must not be negative, got {value}"
    if args.speculative_method != "none" and args.num_speculative_tokens < 1:
        return f"--num-speculative-tokens must be at least 1 with --speculative-method {args.speculative_method}, got {args.num_speculative_tokens}"
    if args.speculative_method != "none" and args.backend == "sim":
        return "--speculative-method needs a model: the sim backend samples without one; choose --backend cpu, cuda or npu"
    problem = speculative_flags_problem(args.speculative_method, args.draft_model)
    if problem:
        return problem
    if args.kv_cache_fraction is not None and not 0.0 < args.kv_cache_fraction <= 1.0:
        return f"--kv-cache-fraction must be in (0, 1], got {args.kv_cache_fraction}"
    return None


def speculative_flags_problem(method: str, draft_model: str | None) -> str | None:
    """What is wrong with ``--speculative-method`` and ``--draft-model`` together (a message saying
    what to change), ``None`` when they fit; ``stageserve up`` checks its own flags with it too."""
    if method == "draft" and not draft_model:
        return "--speculative-method draft needs --draft-model PATH: a smaller GGUF file or Hugging Face directory sharing --model's tokenizer"
    if draft_model and method != "draft":
        return f"--draft-model is used only by --speculative-method draft (got {method}); add --speculative-method draft or drop --draft-model"
    return None


def resolve_dtype(name: str, backend: str) -> str:
    """``--dtype``: ``auto`` is bfloat16 on cuda/npu and on a CPU whose /proc/cpuinfo flags include
    avx512_bf16 or amx_bf16 (native bf16 matmuls), else float32; other names are returned as given."""
    if name != "auto":
        return name
    if backend != "cpu":
        return "bfloat16"
    try:
        flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split())
    except OSError:
        flags = set()
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


def build_core(args: argparse.Namespace, model_path: Path, tracer=None, metrics=None, backend=None):
    """Load the model (or set up the sim), allocate the KV pool and the sequence table, build the executor, warm up.

    ``args`` are the parsed device flags; the in-process benchmark baseline builds its core here too.
    ``tracer`` (a :class:`~stageserve.tracing.Tracer`) gets the executor's spans; ``metrics`` (a
    :class:`~stageserve.device.metrics.DeviceMetrics`) is fed every ticket and output. ``backend``:
    the one to use for ``--backend`` (made here from the flags when ``None``); with an ``on_caller``
    cpu backend, call this inside its ``serve_while`` (the warm-up step runs there).
    """
    import torch

    from stageserve.device.executor import StepExecutor
    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.sampler import validate_sampling_params
    from stageserve.device.sequence_table import SequenceTable
    from stageserve.device.service import CompletionOutbox, DeviceCore
    from stageserve.device.sim import SimStepRunner
    from stageserve.device.step_plan import PlanLimits
    from stageserve.device.step_runner import ModelStepRunner
    from stageserve.sampling_rules import MAX_LOGPROBS

    # The sim sizes its KV pool (host bookkeeping only) as the cpu backend would, from the model's config.
    dtype_name = resolve_dtype(args.dtype, "cpu" if args.backend == "sim" else args.backend)
    dtype = getattr(torch, dtype_name)
    backend, model, config = _load_model(args, model_path, dtype, backend)
    saved_bytes = _log_weight_memory(model, dtype) if model is not None else 0
    draft = _load_draft(args, model_path, dtype, backend.device) if args.speculative_method == "draft" else None
    if draft is not None:
        saved_bytes += _log_weight_memory(draft, dtype)
    num_blocks = _num_blocks(args, config, draft and draft.config, dtype, _kv_bytes(args, backend.device, saved_bytes))
    model_len = min(c.max_position_embeddings for c in (config, draft and draft.config) if c)
    if args.max_model_len is not None:
        if args.max_model_len > model_len:
            raise RuntimeError(f"--max-model-len {args.max_model_len} exceeds the context of the model{' and draft model' * bool(draft)} ({model_len} tokens)")
        model_len = args.max_model_len
    table = SequenceTable(args.max_num_seqs, config.vocab_size, args.block_size, backend.device)
    num_drafts = args.num_speculative_tokens if args.speculative_method != "none" else 0
    limits = PlanLimits(
        max_num_seqs=args.max_num_seqs,
        vocab_size=config.vocab_size,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_step_tokens=args.max_step_tokens,
        max_model_len=min(model_len, num_blocks * args.block_size),
        num_speculative_tokens=num_drafts,
    )
    grammar = speculation = None
    if model is None:
        runner = SimStepRunner(args.sim_step_ms / 1e3, args.sim_token_us / 1e6, config.vocab_size, config.eos_token_ids)
    else:
        grammar = _grammar_table(model_path, config, backend.device, metrics)
        speculation = _speculation(args, limits, draft, dtype, backend.device) if num_drafts else None
        runner = ModelStepRunner(model, PagedKVCache(config, num_blocks, args.block_size, dtype, backend.device), table, grammar, speculation)
    outbox = CompletionOutbox()
    on_ticket, on_output = outbox.push_ticket, outbox.push_output
    if metrics is not None:
        on_ticket, on_output = _both(outbox.push_ticket, metrics.on_ticket), _both(outbox.push_output, metrics.on_output)
    executor = StepExecutor(
        backend, runner,
        pipeline_depth=args.pipeline_depth, max_rows=args.max_num_seqs * (1 + num_drafts), max_top_logprobs=MAX_LOGPROBS,
        dispatch=args.dispatch, on_ticket=on_ticket, on_output=on_output, tracer=tracer,
    )
    if metrics is not None:
        metrics.watch_in_flight(executor.in_flight)

    def check_sampling(params) -> None:
        validate_sampling_params(params, config.vocab_size)

    _warm_up(executor, table, limits, check_sampling)
    if grammar is not None:
        grammar.grammars.wait_ready()
    step_costs = []
    if num_drafts and args.speculative_policy == "goodput" and model is not None:
        from stageserve.device.speculation.step_costs import measure_step_costs

        # After the grammar worker's start-up work: it would take a core from the measured steps.
        step_costs = measure_step_costs(executor, table, limits, check_sampling, speculation)
    outbox.clear()
    attach_reply = _attach_reply(args, model_path, config, limits, backend.name, dtype_name, step_costs,
                                 speculation is not None and speculation.drops_unproposed)
    return DeviceCore(attach_reply, limits, table, executor, outbox, check_sampling, grammar)


def _grammar_table(model_path: Path, config, device, metrics):
    """Structured output's grammar state; the tokenizer's vocabulary is read on the grammar worker.
    ``metrics`` (or ``None``) gets compile times and the constrained-sequence count."""
    import xgrammar

    from stageserve.device.grammar import CompiledGrammars, GrammarTable
    from stageserve.tokenizer import load_tokenizer

    def tokenizer_info() -> xgrammar.TokenizerInfo:
        tokenizer = load_tokenizer(model_path)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size, stop_token_ids=list(config.eos_token_ids))

    table = GrammarTable(CompiledGrammars(tokenizer_info, on_compile=metrics.on_compile if metrics else lambda *a: None), config.vocab_size, device)
    if metrics is not None:
        metrics.watch_constrained(table.active_count)
    return table


def _num_blocks(args: argparse.Namespace, config, draft_config, dtype, kv_bytes: int) -> int:
    """KV blocks that fit in ``kv_bytes``: the target's pool, and with ``draft_config`` (or ``None``)
    the draft model's pool of as many blocks beside it (`kv_cache.num_blocks_for_memory`); logs the split.

    Raises:
        RuntimeError: not even one block fits.
    """
    from stageserve.device.model.kv_cache import bytes_per_block, num_blocks_for_memory

    num_blocks = num_blocks_for_memory(config, args.block_size, dtype, kv_bytes, draft_config)
    if num_blocks < 1:
        raise RuntimeError(f"--kv-cache-memory/--kv-cache-fraction: {kv_bytes} bytes hold no KV block of {args.block_size} tokens; give more memory")
    if draft_config is not None:
        log.info("KV memory %.1f MiB holds %d blocks of %d tokens in two pools indexed by the same block ids: the target's %.1f MiB, "
                 "the draft model's %.1f MiB (+ 1 scratch block)", kv_bytes / 2**20, num_blocks, args.block_size,
                 num_blocks * bytes_per_block(config, args.block_size, dtype) / 2**20,
                 num_blocks * bytes_per_block(draft_config, args.block_size, dtype) / 2**20)
    return num_blocks


def _speculation(args: argparse.Namespace, limits, draft, dtype, device):
    """The device's `Speculation` for ``--speculative-method`` (``draft``: over the loaded ``draft`` model)."""
    from stageserve.device.speculation.draft_model import DraftModelProposer
    from stageserve.device.speculation.proposer import PROPOSERS
    from stageserve.device.speculation.verification import Speculation

    if args.speculative_method == "draft":
        proposer = DraftModelProposer(draft, limits.vocab_size, limits.num_blocks, limits.block_size, dtype)
    else:
        proposer = PROPOSERS[args.speculative_method]()
    return Speculation(proposer, limits.num_speculative_tokens, limits.max_num_seqs, limits.max_model_len, limits.block_size, device)


def _load_draft(args: argparse.Namespace, model_path: Path, dtype, device):
    """``--draft-model``, loaded as the target is, after checking that its tokenizer is the target's
    (the same token -> id map; the embedding tables may be padded to other sizes).

    Raises:
        FileNotFoundError: no such path.
        ModelLoadError: not loadable, or its tokenizer differs from the target's (the message says what to change).
    """
    from stageserve.device.model.config import ModelLoadError

    draft_path = resolve_model_path(args.draft_model, "--draft-model")
    if draft_path.resolve() != model_path.resolve():
        target, draft = _vocabulary(model_path), _vocabulary(draft_path)
        if draft != target:
            differs = f"its tokenizer has {len(draft)} tokens, --model's has {len(target)}" if len(draft) != len(target) else \
                "its tokenizer gives some tokens other ids than --model's"
            raise ModelLoadError(f"--draft-model {draft_path}: {differs}; choose a draft model that shares the target's tokenizer "
                                 "(a smaller model of the same family)")
    return _load_llama(args, draft_path, dtype, device)


def _vocabulary(path: Path) -> dict[str, int]:
    """Token -> id of the tokenizer of the model at ``path``. Raises ``ModelLoadError`` where there is none."""
    from stageserve.device.model.config import ModelLoadError
    from stageserve.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path).get_vocab()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def _load_model(args: argparse.Namespace, model_path: Path, dtype, backend):
    """(backend, model, model config) for ``--backend``: the sim has no model, only the config."""
    from stageserve.device.backends import create_backend
    from stageserve.device.sim import SimBackend
    from stageserve.device.model.weights import load_config

    if args.backend == "sim":
        log.info("simulated device: %s's config, no weights; %g ms per step + %g us per token", model_path.name, args.sim_step_ms, args.sim_token_us)
        return SimBackend(), None, load_config(model_path)
    backend = backend or create_backend(args.backend, args.threads)
    model = _load_llama(args, model_path, dtype, backend.device)
    return backend, model, model.config


def _load_llama(args: argparse.Namespace, path: Path, dtype, device):
    """The `LlamaModel` at ``path`` on ``device``, with the flags' weight format and kernels (``--model`` and ``--draft-model`` alike)."""
    import torch

    from stageserve.device.model.decoder import LlamaModel

    log.info("loading %s as %s on %s", path, str(dtype).removeprefix("torch."), device)
    weight_format = args.weights
    from stageserve.device.kernels import cpu_kernels

    # The VNNI kernel takes bfloat16 and float32; torch's int4/int8 CPU kernels are fast with bfloat16
    # input only (float32: ~9 ms per 576x576 int4 row, measured).
    vnni = torch.device(device).type == "cpu" and cpu_kernels.has_avx512_vnni()
    if weight_format == "auto" and not (dtype == torch.bfloat16 or (dtype == torch.float32 and vnni)):
        log.info("--weights auto: %s activations keep every weight dense (the quantized kernels here need %s)",
                 str(dtype).removeprefix("torch."), "bfloat16 or float32" if vnni else "bfloat16")
        weight_format = "dequantize"
    model = LlamaModel.from_path(path, dtype, device, cpu_kernels_allowed=not args.no_cpu_kernels, amx_allowed=not args.no_amx_linears,
                                 weight_format=weight_format, dense_copy=not args.no_dense_copy)
    log.info("layers run %s%s", "with the fused CPU kernels" if model.cpu_kernels else "in plain torch ops",
             ", decode-sized linears on AMX" if model.amx_linears else "")
    return model


def _kv_bytes(args: argparse.Namespace, device, saved_bytes: int = 0) -> int:
    """Bytes for the KV pool: ``--kv-cache-memory``, else ``--kv-cache-fraction`` of the free
    accelerator memory (a default fraction on cuda/npu), else a fixed default on the cpu and the sim
    plus ``saved_bytes``, what quantized weights save against one dense copy."""
    from stageserve.device.model.kv_cache import kv_memory_budget

    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    if args.kv_cache_fraction is not None or args.backend not in ("cpu", "sim"):
        return kv_memory_budget(device, args.kv_cache_fraction or ACCELERATOR_DEFAULT_KV_FRACTION)
    return CPU_DEFAULT_KV_BYTES + saved_bytes


def _attach_reply(args: argparse.Namespace, model_path: Path, config, limits, backend_name: str, dtype_name: str, step_costs: list,
                  drops_unproposed: bool):
    """The ``AttachReply`` of a device built from ``args`` (a new ``instance_id``), with the measured
    ``step_costs`` and whether its steps run only the proposed drafts' entries."""
    from stageserve.v1 import device_pb2

    return device_pb2.AttachReply(
        model_name=EMBEDDED_MODEL_NAME if not args.model else model_path.stem if model_path.is_file() else model_path.name,
        vocab_size=config.vocab_size,
        eos_token_ids=config.eos_token_ids,
        max_model_len=limits.max_model_len,
        kv_block_size=limits.block_size,
        kv_num_blocks=limits.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_step_tokens=args.max_step_tokens,
        pipeline_depth=args.pipeline_depth,
        backend=backend_name,
        dtype=dtype_name,
        dispatch=args.dispatch,
        instance_id=uuid.uuid4().hex,
        num_speculative_tokens=limits.num_speculative_tokens,
        speculative_method=args.speculative_method if limits.num_speculative_tokens else "",
        step_costs=step_costs,
        drops_unproposed_drafts=drops_unproposed,
    )


def _log_weight_memory(model, dtype) -> int:
    """Log the linears' formats, the weights' bytes against one dense copy in ``dtype``, and resident memory; the bytes saved (>= 0)."""
    dense = model.dense_weight_bytes(dtype)
    held = model.weight_bytes()
    formats = ", ".join(f"{count} {name}" for name, count in sorted(model.linear_formats.items()))
    log.info("linears: %s; weights hold %.1f MiB (one dense %s copy: %.1f MiB, %.2fx); resident memory %.1f MiB",
             formats, held / 2**20, str(dtype).removeprefix("torch."), dense / 2**20, held / dense, resident_bytes() / 2**20)
    return max(0, dense - held)


def resident_bytes(pid: int | str = "self") -> int:
    """Resident set size of process ``pid`` (default this one) in bytes: VmRSS of /proc/PID/status; 0 where that is not readable."""
    try:
        line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def _both(first, then):
    """A callback calling ``first`` then ``then`` with the same arguments."""
    def call(*args) -> None:
        first(*args)
        then(*args)
    return call


def _warm_up(executor, table, limits, check_sampling) -> None:
    """Run ONE step (a short greedy prefill) through the whole submit/complete path, then forget it.

    It writes KV blocks that prepare will overwrite before reading; the table is reset afterwards.

    Raises:
        RuntimeError: the warm-up step failed (the message carries the step's error).
    """
    from stageserve.device.speculation.step_costs import GREEDY, run_alone
    from stageserve.v1 import common_pb2, device_pb2

    tokens = list(range(min(8, limits.block_size * limits.num_blocks, limits.max_model_len)))
    blocks = -(-len(tokens) // limits.block_size)
    start = common_pb2.SequenceStart(
        seq_index=0, generation=1, request_id="warm-up", prompt_token_ids=tokens, sampling=GREEDY,
    )
    plan = device_pb2.StepPlan(
        step_id=1, started=[start], seq_index=[0], generation=[1], start_pos=[0], num_tokens=[len(tokens)],
        token_ids=tokens, sample=[True], num_new_blocks=[blocks], new_block_ids=list(range(blocks)),
    )
    run_alone(executor, table, limits, check_sampling, plan, "warm-up step")
    table.reset()
