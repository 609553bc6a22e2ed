"""``stageserve device``: command line and start-up of the device service (model, KV cache, executor).

Start-up order: listen (readiness NOT_SERVING) → load the weights → size and allocate the KV pool
→ run ONE warm-up step through the executor → readiness SERVING. torch is imported inside
:func:`run`, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import logging
import re
import uuid
from pathlib import Path

from stageserve.model_files import EMBEDDED_MODEL_NAME, resolve_model_path
from stageserve.server import configure_logging

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
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
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and activations; auto = bfloat16 on cuda/npu and on CPUs with avx512_bf16 or amx_bf16, else float32")
    parser.add_argument("--backend", choices=("cpu", "cuda", "npu"), default="cpu", help="where steps run (default %(default)s)")
    parser.add_argument("--dispatch", choices=("async", "sync"), default="async", help="async: submit without waiting; sync: wait each step before the next (for comparison)")
    parser.add_argument("--pipeline-depth", type=int, default=2, metavar="N", help="output slots = steps in flight at most (default %(default)s)")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES", help="KV pool size, e.g. 512MiB (default: 512MiB on cpu)")
    kv.add_argument("--kv-cache-fraction", type=float, default=None, metavar="F", help=f"KV pool as this fraction of free device memory after loading (default on cuda/npu: {ACCELERATOR_DEFAULT_KV_FRACTION})")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS", help="tokens per KV block (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=256, metavar="N", help="sequence table size = sequences in flight at most (default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS", help="longest sequence (prompt + output) to accept (default: the model's context, capped by the KV pool)")
    parser.add_argument("--max-step-tokens", type=int, default=2048, metavar="TOKENS", help="tokens one step may carry (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=50052, help="port to listen on; 0 = ephemeral (default %(default)s)")
    parser.add_argument("--port-file", type=Path, default=None, help="write the bound port to this file once listening")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS", help="on SIGTERM, wait this long for in-flight steps to be delivered (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Run the device service; return the exit code (0 after SIGTERM and drain, 2 on bad flags or model)."""
    configure_logging(args.log_level)
    problem = _check_flags(args)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        model_path = resolve_model_path(args.model)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2

    import torch  # noqa: F401 - heavy imports only past --help

    from stageserve.device import service
    from stageserve.device.model_config import ModelLoadError
    from stageserve.server import ServiceServer
    from stageserve.v1 import device_pb2_grpc

    # 1. Listen at once, NOT_SERVING, so orchestrators see a live process while the model loads.
    server = ServiceServer(service.SERVICE_NAME, args.host, args.port, port_file=args.port_file)
    servicer = service.DeviceServicer()
    server.add_servicer(device_pb2_grpc.add_DeviceServicer_to_server, servicer)
    server.start([service.SERVICE_NAME])
    # 2. Load, size the KV pool, warm up.
    try:
        core = _build_core(args, model_path)
    except (ModelLoadError, FileNotFoundError) as exc:
        log.error("cannot load the model: %s", exc)
        server.server.stop(0)
        return 2
    except RuntimeError as exc:  # device not available, KV pool does not fit, ...
        log.error("%s", exc)
        server.server.stop(0)
        return 2
    # 3. Serve until SIGTERM, then drain.
    servicer.serve(core)
    server.set_ready(True)
    facts = core.facts
    log.info("device ready: %s on %s (%s, %s dispatch, depth %d), %d KV blocks of %d tokens, instance %s",
             facts.model_name, facts.backend, facts.dtype, facts.dispatch, facts.pipeline_depth, facts.kv_num_blocks, facts.kv_block_size, facts.instance_id)

    def drain() -> None:
        if not core.executor.flush(args.drain_timeout) or not core.outbox.wait_empty(args.drain_timeout):
            log.warning("drain timeout: steps or outputs still in flight")

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
    if args.kv_cache_fraction is not None and not 0.0 < args.kv_cache_fraction <= 1.0:
        return f"--kv-cache-fraction must be in (0, 1], got {args.kv_cache_fraction}"
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


def _build_core(args: argparse.Namespace, model_path: Path):
    """Load the model, allocate the KV pool and the sequence table, build the executor, warm up."""
    import torch

    from stageserve.device.backends import create_backend
    from stageserve.device.executor import StepExecutor
    from stageserve.device.kv_cache import PagedKVCache, kv_memory_budget, num_blocks_for_memory
    from stageserve.device.model import LlamaModel
    from stageserve.device.sampler import MAX_LOGPROBS, validate_sampling_params
    from stageserve.device.sequence_table import SequenceTable
    from stageserve.device.service import CompletionOutbox, DeviceCore
    from stageserve.device.step_plan import PlanLimits
    from stageserve.device.step_runner import ModelStepRunner
    from stageserve.v1 import device_pb2

    backend = create_backend(args.backend, args.threads)
    dtype_name = resolve_dtype(args.dtype, args.backend)
    log.info("loading %s as %s on %s", model_path, dtype_name, backend.device)
    model = LlamaModel.from_path(model_path, getattr(torch, dtype_name), backend.device)
    config = model.config

    if args.kv_cache_memory is not None:
        kv_bytes = args.kv_cache_memory
    elif args.kv_cache_fraction is not None or args.backend != "cpu":
        kv_bytes = kv_memory_budget(backend.device, args.kv_cache_fraction or ACCELERATOR_DEFAULT_KV_FRACTION)
    else:
        kv_bytes = CPU_DEFAULT_KV_BYTES
    num_blocks = num_blocks_for_memory(config, args.block_size, model.dtype, kv_bytes)
    if num_blocks < 1:
        raise RuntimeError(f"--kv-cache-memory/--kv-cache-fraction: {kv_bytes} bytes hold no KV block of {args.block_size} tokens; give more memory")
    model_len = config.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > model_len:
            raise RuntimeError(f"--max-model-len {args.max_model_len} exceeds the model's context of {model_len} tokens")
        model_len = args.max_model_len
    kv_cache = PagedKVCache(config, num_blocks, args.block_size, model.dtype, backend.device)
    table = SequenceTable(args.max_num_seqs, config.vocab_size, args.block_size, backend.device)
    limits = PlanLimits(
        max_num_seqs=args.max_num_seqs,
        vocab_size=config.vocab_size,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_step_tokens=args.max_step_tokens,
        max_model_len=min(model_len, num_blocks * args.block_size),
    )
    outbox = CompletionOutbox()
    executor = StepExecutor(
        backend, ModelStepRunner(model, kv_cache, table),
        pipeline_depth=args.pipeline_depth, max_rows=args.max_num_seqs, max_top_logprobs=MAX_LOGPROBS,
        dispatch=args.dispatch, on_ticket=outbox.push_ticket, on_output=outbox.push_output,
    )

    def check_sampling(params) -> None:
        validate_sampling_params(params, config.vocab_size)

    _warm_up(executor, table, limits, check_sampling)
    outbox.clear()
    facts = device_pb2.AttachReply(
        model_name=EMBEDDED_MODEL_NAME if not args.model else model_path.stem if model_path.is_file() else model_path.name,
        vocab_size=config.vocab_size,
        eos_token_ids=config.eos_token_ids,
        max_model_len=limits.max_model_len,
        kv_block_size=args.block_size,
        kv_num_blocks=num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_step_tokens=args.max_step_tokens,
        pipeline_depth=args.pipeline_depth,
        backend=backend.name,
        dtype=dtype_name,
        dispatch=args.dispatch,
        instance_id=uuid.uuid4().hex,
    )
    return DeviceCore(facts, limits, table, executor, outbox, check_sampling)


def _warm_up(executor, table, limits, check_sampling) -> None:
    """Run ONE step (a short greedy prefill) through the whole submit/complete path, then forget it.

    It writes KV blocks that prepare will overwrite before reading; the table is reset afterwards.

    Raises:
        RuntimeError: the warm-up step failed (the message carries the step's error).
    """
    from stageserve.device.step_plan import decode_plan
    from stageserve.v1 import common_pb2, device_pb2

    tokens = list(range(min(8, limits.block_size * limits.num_blocks, limits.max_model_len)))
    blocks = -(-len(tokens) // limits.block_size)
    start = common_pb2.SequenceStart(
        seq_index=0, generation=1, request_id="warm-up", prompt_token_ids=tokens,
        sampling=common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0),
    )
    plan = device_pb2.StepPlan(
        step_id=1, started=[start], seq_index=[0], generation=[1], start_pos=[0], num_tokens=[len(tokens)],
        token_ids=tokens, sample=[True], num_new_blocks=[blocks], new_block_ids=list(range(blocks)),
    )
    step = decode_plan(plan, limits, check_sampling)
    table.admit(step)
    ticket = executor.submit(step)
    try:
        ticket.wait()
    except Exception as exc:
        raise RuntimeError(f"warm-up step failed: {type(exc).__name__}: {exc}") from exc
    executor.flush()
    executor.release(ticket.ticket_id)
    table.reset()
