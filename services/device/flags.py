"""The device service's command-line flags and their checks (torch-free: ``stageserve up``, the benchmarks and
``--help`` import it without loading torch)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from stageserve.server import add_service_arguments

GRAMMAR_COMPILE_BUDGET_S = 5.0
"""Seconds a constraint's grammar may take to compile (``--grammar-compile-budget``): typical
schemas take 10-50 ms, a 43 KB object schema of 1,500 optional properties 8.3 s (2-core AMD EPYC)."""

DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("auto", "dequantize", "int8", "int4")  # --weights; stageserve.device.kernels.quant maps each onto kernels
DENSE_COPY_MODES = ("auto", "all", "none")  # --dense-copy: DecoderModel's dense_copy (stageserve.device.kernels.dense_copies)
# ngram: stageserve.device.speculation.proposer.PROPOSERS; draft: stageserve.device.speculation.draft_model; mtp:
# stageserve.device.speculation.mtp (all import torch)
PROPOSER_NAMES = ("ngram", "draft", "mtp")
SPECULATIVE_POLICIES = ("goodput", "always")  # --speculative-policy (docs/speculative.md#which-rows-draft)
CPU_DEFAULT_KV_CONTEXTS = 2
"""The cpu backend's default KV pool holds this many sequences of the longest length accepted (the
model's context, or --max-model-len): one of that length never waits for a second to finish, and
shorter ones share the pool (plus what quantized weights save against one dense copy)..."""
CPU_DEFAULT_KV_TOKENS_PER_SEQ = 64
"""...or, where that is more, this many tokens for every sequence the table holds (--max-num-seqs):
a short-context model still runs its sequence table full."""
CPU_MAX_KV_FRACTION = 0.25
"""The default pool takes at most this fraction of the memory available when the device starts."""
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
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights and activations; auto = bfloat16 on cuda/npu, on CPUs with avx512_bf16 or amx_bf16, and where quantized weights run on the VNNI kernel; else float32")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="auto",
                        help="cpu backend: auto = a GGUF's Q4_0/Q4_1 linears on int4 kernels and Q8_0 on int8 ones, everything else in --dtype; "
                             "dequantize = every weight in --dtype; int8/int4 = every linear in that format (default %(default)s)")
    parser.add_argument("--backend", choices=("cpu", "cuda", "npu", "sim"), default="cpu",
                        help="where steps run; sim = simulated device: no weights, each step takes --sim-step-ms without computing (default %(default)s)")
    parser.add_argument("--sim-step-ms", type=float, default=5.0, metavar="MS", help="--backend sim: device time of every step (default %(default)s)")
    parser.add_argument("--sim-token-us", type=float, default=0.0, metavar="US", help="--backend sim: added device time per token a step carries (default %(default)s)")
    parser.add_argument("--dense-copy", choices=DENSE_COPY_MODES, default="auto",
                        help="quantized weights: which linears also keep a dense copy for inputs of more rows than the quantized kernel takes "
                             "(8, or 4 on torch's kernels): auto, those where it is faster on this CPU (timed at start-up) within one dense "
                             "copy of the model in all (AMX copies: all that are faster); all; none (least memory: many-row inputs run on "
                             "the VNNI kernel, slower) (default: %(default)s)")
    parser.add_argument("--no-dense-copy", dest="dense_copy", action="store_const", const="none", help="the same as --dense-copy none")
    parser.add_argument("--dispatch", choices=("async", "sync"), default="async", help="async: submit without waiting; sync: wait each step before the next (for comparison)")
    parser.add_argument("--grammar-compile-budget", type=float, default=GRAMMAR_COMPILE_BUDGET_S, metavar="SECONDS",
                        help="structured output: seconds a constraint's grammar may take to compile; one that takes longer is refused "
                             "with INVALID_ARGUMENT naming this budget (default %(default)s)")
    spec = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    spec.add_argument("--speculative-method", choices=("none", *PROPOSER_NAMES), default="none",
                      help="ngram: prompt lookup, drafts copied from the sequence's own prompt and output; "
                           "draft: a smaller model (--draft-model) drafts greedily; "
                           "mtp: the checkpoint's own multi-token-prediction layer drafts greedily (DeepSeek-V3's num_nextn_predict_layers) "
                           "(default %(default)s)")
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
    kv.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES", help=f"KV pool size, e.g. 512MiB (default on cpu: {CPU_DEFAULT_KV_CONTEXTS} sequences of --max-model-len "
                    f"or {CPU_DEFAULT_KV_TOKENS_PER_SEQ} tokens per --max-num-seqs, whichever is more, "
                    f"at most {CPU_MAX_KV_FRACTION * 100:.0f}%% of the available memory; its pages are held as they are first written)")
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


def check_flags(args: argparse.Namespace) -> str | None:
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


def resolve_dtype(name: str, backend: str, quantized_kernels: bool = False) -> str:
    """``--dtype``: ``auto`` is bfloat16 on cuda/npu, on a CPU whose /proc/cpuinfo flags include
    avx512_bf16 or amx_bf16 (native bf16 matmuls), and where the model's linears run on the VNNI
    kernel (``quantized_kernels``: it reads bfloat16 at half float32's bytes and takes one input level
    for it), else float32; other names are returned as given.

    On a CPU without native bf16 (a 2-core Intel Xeon, Ice Lake, 2026-12-07; docs/benchmarks.md) the
    embedded Q4_1 model served 32 streams at 675 tok/s in bfloat16 against 408 in float32, one stream
    10.9 against 12.0 ms a token; dense weights stay float32 there (a 32-row step 76 ms against 206
    on oneDNN's emulated bfloat16).
    """
    if name != "auto":
        return name
    if backend != "cpu" or quantized_kernels:
        return "bfloat16"
    try:
        flags = set(next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split())
    except OSError:
        flags = set()
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"
