"""Assembly of the device service: load the model (or set up the sim), size and allocate the KV pool,
build the sequence table, the step runner and the executor, wire the executor's tickets and outputs
into the completion outbox, warm up, measure the step costs: :func:`build_core`.

``stageserve device`` (``main.py``) and the in-process benchmark baseline build their `DeviceCore`
here. torch is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import uuid
from pathlib import Path

from stageserve.device.flags import ACCELERATOR_DEFAULT_KV_FRACTION, CPU_DEFAULT_KV_CONTEXTS, CPU_DEFAULT_KV_TOKENS_PER_SEQ, CPU_MAX_KV_FRACTION, resolve_dtype
from stageserve.model_files import EMBEDDED_MODEL_NAME, resolve_model_path
from stageserve.process_memory import resident_bytes, return_freed_memory

log = logging.getLogger(__name__)


def build_core(args: argparse.Namespace, model_path: Path, tracer=None, metrics=None, backend=None):
    """Load the model (or set up the sim), allocate the KV pool and the sequence table, build the executor, warm up.

    ``args`` are the parsed device flags; the in-process benchmark baseline builds its core here too.
    ``tracer`` (a :class:`~stageserve.tracing.Tracer`) gets the executor's spans; ``metrics`` (a
    :class:`~stageserve.device.metrics.DeviceMetrics`) is fed every ticket and output. ``backend``:
    the one to use for ``--backend`` (made here from the flags when ``None``); with an ``on_caller``
    cpu backend, call this inside its ``serve_while`` (the warm-up step runs there).
    """
    import torch

    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.sampler import validate_sampling_params
    from stageserve.device.sequence_table import SequenceTable
    from stageserve.device.service import CompletionOutbox, DeviceCore
    from stageserve.device.sim import SimStepRunner
    from stageserve.device.step_runner import ModelStepRunner

    dtype_name = device_dtype(args, model_path)
    dtype = getattr(torch, dtype_name)
    backend, model, config = _load_model(args, model_path, dtype, backend)
    saved_bytes = _log_weight_memory(model, dtype) if model is not None else 0
    # The draft model or the checkpoint's MTP layer: a second model with a KV pool of its own.
    draft = mtp = None
    if args.speculative_method == "draft":
        draft = _load_draft(args, model_path, dtype, backend.device)
    elif args.speculative_method == "mtp" and model is not None:
        from stageserve.device.speculation.mtp import MTPModule

        mtp = MTPModule.from_path(model_path, dtype, backend.device, cpu_kernels_allowed=not args.no_cpu_kernels)
        log.info("--speculative-method mtp: the checkpoint's multi-token-prediction layer %d drafts", config.num_layers)
    for second in (draft, mtp and mtp.block):
        if second is not None:
            saved_bytes += _log_weight_memory(second, dtype)
    draft = draft or mtp
    num_blocks = _num_blocks(args, config, draft and draft.config, dtype, _kv_bytes(args, backend.device, [config, draft and draft.config], dtype, saved_bytes))
    limits = _plan_limits(args, config, draft and draft.config, num_blocks)
    pooling = _pooling(config, model is not None and not limits.num_speculative_tokens)
    embedding_width = config.hidden_size if pooling else 0
    table = SequenceTable(args.max_num_seqs, config.vocab_size, args.block_size, backend.device, embedding_width)
    grammar = speculation = None
    if model is None:
        runner = SimStepRunner(args.sim_step_ms / 1e3, args.sim_token_us / 1e6, config.vocab_size, config.eos_token_ids)
    else:
        grammar = _grammar_table(model_path, config, backend.device, metrics, args.grammar_compile_budget)
        speculation = _speculation(args, limits, model, draft, dtype, backend.device) if limits.num_speculative_tokens else None
        runner = ModelStepRunner(model, PagedKVCache(config, num_blocks, args.block_size, dtype, backend.device), table, grammar, speculation)
    outbox = CompletionOutbox()
    executor = _executor(args, backend, runner, outbox, limits, tracer, metrics, embedding_width)

    def check_sampling(params) -> None:
        validate_sampling_params(params, config.vocab_size)

    _warm_up(executor, table, limits, check_sampling)
    step_costs = []
    if speculation is not None and args.speculative_policy == "goodput":
        from stageserve.device.speculation.step_costs import measure_step_costs

        step_costs = measure_step_costs(executor, table, limits, check_sampling, speculation)
    outbox.clear()
    return_freed_memory()  # what loading, the dense-copy timings and the warm-up freed
    log.info("resident memory %.1f MiB after warm-up", resident_bytes() / 2**20)
    attach_reply = _attach_reply(args, model_path, config, limits, backend.name, dtype_name, step_costs,
                                 speculation is not None and speculation.drops_unproposed)
    attach_reply.pooling, attach_reply.hidden_size = pooling, embedding_width
    attach_reply.kv_window = kv_window(config, draft and draft.config)
    return DeviceCore(attach_reply, limits, table, executor, outbox, check_sampling, grammar)


def kv_window(config, draft_config=None) -> int:
    """``AttachReply.kv_window`` of a pool shared by ``config``'s model and ``draft_config``'s (or
    ``None``): the widest of their windows (`ModelConfig.kv_window`), 0 when either has a layer without one."""
    windows = [c.kv_window for c in (config, draft_config) if c is not None]
    return 0 if None in windows else max(windows)


def _plan_limits(args: argparse.Namespace, config, draft_config, num_blocks: int):
    """The `PlanLimits` of a device of ``num_blocks`` KV blocks serving ``config`` (and ``draft_config``, or ``None``).

    Raises:
        RuntimeError: ``--max-model-len`` exceeds the context of the model (or of the draft model).
    """
    from stageserve.device.step_plan import PlanLimits

    model_len = min(c.max_position_embeddings for c in (config, draft_config) if c)
    if args.max_model_len is not None:
        if args.max_model_len > model_len:
            raise RuntimeError(f"--max-model-len {args.max_model_len} exceeds the context of the model{' and draft model' * bool(draft_config)} ({model_len} tokens)")
        model_len = args.max_model_len
    return PlanLimits(
        max_num_seqs=args.max_num_seqs,
        vocab_size=config.vocab_size,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_step_tokens=args.max_step_tokens,
        max_model_len=min(model_len, num_blocks * args.block_size),
        num_speculative_tokens=args.num_speculative_tokens if args.speculative_method != "none" else 0,
    )


def _pooling(config, can_embed: bool) -> int:
    """The ``common_pb2.Pooling`` embeddings get: the model's (``config.pooling``), or NONE where the
    device cannot embed (the sim; a speculating device, whose steps reorder their entries) or the
    model pools in a way the device lacks (logged)."""
    from stageserve.v1 import common_pb2

    pooling = {"mean": common_pb2.POOLING_MEAN, "last": common_pb2.POOLING_LAST}.get(config.pooling, common_pb2.POOLING_NONE)
    if can_embed and not pooling:
        log.warning("embeddings are not served: the model pools by %r (this device pools by mean or last)", config.pooling)
    return pooling if can_embed else common_pb2.POOLING_NONE


def _executor(args: argparse.Namespace, backend, runner, outbox, limits, tracer, metrics, embedding_width: int):
    """The `StepExecutor` over ``runner`` on ``backend``: its ticket callback pushes each step's ticket
    into ``outbox`` (toward reclaim) at submit, its output callback the step's output at completion;
    ``metrics`` (or ``None``) sees both; ``embedding_width``: the hidden size where steps output embeddings."""
    from stageserve.device.executor import StepExecutor
    from stageserve.sampling_rules import MAX_LOGPROBS

    on_ticket, on_output = outbox.push_ticket, outbox.push_output
    if metrics is not None:
        on_ticket, on_output = _both(outbox.push_ticket, metrics.on_ticket), _both(outbox.push_output, metrics.on_output)
    executor = StepExecutor(
        backend, runner,
        pipeline_depth=args.pipeline_depth, max_rows=args.max_num_seqs * (1 + limits.num_speculative_tokens), max_top_logprobs=MAX_LOGPROBS,
        embedding_width=embedding_width, dispatch=args.dispatch, on_ticket=on_ticket, on_output=on_output, tracer=tracer,
    )
    if metrics is not None:
        metrics.watch_in_flight(executor.in_flight)
    return executor


def _grammar_table(model_path: Path, config, device, metrics, budget_s: float):
    """Structured output's grammar state; the tokenizer's vocabulary is read at the first constraint.
    ``metrics`` (or ``None``) gets compile times and the constrained-sequence count; ``budget_s``:
    ``--grammar-compile-budget``."""
    from stageserve.device.grammar import CompiledGrammars, GrammarTable

    def tokenizer_info():
        import xgrammar

        from stageserve.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path)
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size, stop_token_ids=list(config.eos_token_ids))

    grammars = CompiledGrammars(tokenizer_info, on_compile=metrics.on_compile if metrics else lambda *a: None, budget_s=budget_s)
    table = GrammarTable(grammars, config.vocab_size, device)
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
                 "the draft's (draft model or MTP layer) %.1f MiB (+ 1 scratch block)", kv_bytes / 2**20, num_blocks, args.block_size,
                 num_blocks * bytes_per_block(config, args.block_size, dtype) / 2**20,
                 num_blocks * bytes_per_block(draft_config, args.block_size, dtype) / 2**20)
    else:
        log.info("KV pool: %d blocks of %d tokens, %.1f MiB%s", num_blocks, args.block_size,
                 num_blocks * bytes_per_block(config, args.block_size, dtype) / 2**20,
                 " (held as blocks are first written)" if args.backend in ("cpu", "sim") else "")
    return num_blocks


def _speculation(args: argparse.Namespace, limits, model, draft, dtype, device):
    """The device's `Speculation` for ``--speculative-method`` (``draft``: over the loaded ``draft``
    model; ``mtp``: ``draft`` is the target ``model``'s `mtp.MTPModule`)."""
    from stageserve.device.speculation.draft_model import DraftModelProposer
    from stageserve.device.speculation.mtp import MTPProposer
    from stageserve.device.speculation.proposer import PROPOSERS
    from stageserve.device.speculation.verification import Speculation

    if args.speculative_method == "draft":
        proposer = DraftModelProposer(draft, limits.vocab_size, limits.num_blocks, limits.block_size, dtype)
    elif args.speculative_method == "mtp":
        proposer = MTPProposer(model, draft, limits.num_speculative_tokens, limits.max_num_seqs, limits.num_blocks, limits.block_size, dtype)
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
    return _load_decoder(args, draft_path, dtype, device)


def _vocabulary(path: Path) -> dict[str, int]:
    """Token -> id of the tokenizer of the model at ``path``. Raises ``ModelLoadError`` where there is none."""
    from stageserve.device.model.config import ModelLoadError
    from stageserve.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path).get_vocab()
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc


def device_dtype(args: argparse.Namespace, model_path: Path) -> str:
    """``--dtype`` as this device runs the model at ``model_path`` (`resolve_dtype`; ``auto`` weighs
    whether the linears run on the VNNI kernel). The sim sizes its KV pool (host bookkeeping only) as
    the cpu backend would, so it resolves as the cpu does.

    Raises:
        ModelLoadError: ``--weights auto`` on an unreadable or corrupt GGUF file.
    """
    backend = "cpu" if args.backend == "sim" else args.backend
    return resolve_dtype(args.dtype, backend, backend == "cpu" and _linears_on_vnni_kernel(args, model_path))


def _linears_on_vnni_kernel(args: argparse.Namespace, model_path: Path) -> bool:
    """Whether the model's linears run quantized on the VNNI kernel (on the cpu backend): the CPU kernels
    allowed and running here, and ``--weights int8``/``int4``, or ``auto`` on a GGUF file holding quantized linears."""
    if args.weights == "dequantize":
        return False
    from stageserve.device.kernels.quant_linear import vnni_kernel_runs
    from stageserve.device.model.weights import holds_quantized_linears

    return vnni_kernel_runs(not args.no_cpu_kernels) and (args.weights != "auto" or holds_quantized_linears(model_path))


def _load_model(args: argparse.Namespace, model_path: Path, dtype, backend):
    """(backend, model, model config) for ``--backend``: the sim has no model, only the config."""
    from stageserve.device.backends import create_backend
    from stageserve.device.sim import SimBackend
    from stageserve.device.model.weights import load_config

    if args.backend == "sim":
        log.info("simulated device: %s's config, no weights; %g ms per step + %g us per token", model_path.name, args.sim_step_ms, args.sim_token_us)
        return SimBackend(), None, load_config(model_path)
    backend = backend or create_backend(args.backend, args.threads)
    model = _load_decoder(args, model_path, dtype, backend.device)
    return backend, model, model.config


def _load_decoder(args: argparse.Namespace, path: Path, dtype, device):
    """The `DecoderModel` at ``path`` on ``device``, with the flags' weight format and kernels (``--model`` and ``--draft-model`` alike)."""
    import torch

    from stageserve.device.model.decoder import DecoderModel

    log.info("loading %s as %s on %s", path, str(dtype).removeprefix("torch."), device)
    weight_format = args.weights
    from stageserve.device.kernels.quant_linear import vnni_kernel_runs

    # The VNNI kernel takes bfloat16 and float32; torch's int4/int8 CPU kernels are fast with bfloat16
    # input only (float32: ~9 ms per 576x576 int4 row, measured).
    vnni = torch.device(device).type == "cpu" and vnni_kernel_runs(not args.no_cpu_kernels)
    if weight_format == "auto" and not (dtype == torch.bfloat16 or (dtype == torch.float32 and vnni)):
        log.info("--weights auto: %s activations keep every weight dense (the quantized kernels here need %s)",
                 str(dtype).removeprefix("torch."), "bfloat16 or float32" if vnni else "bfloat16")
        weight_format = "dequantize"
    model = DecoderModel.from_path(path, dtype, device, cpu_kernels_allowed=not args.no_cpu_kernels, amx_allowed=not args.no_amx_linears,
                                 weight_format=weight_format, dense_copy=args.dense_copy)
    log.info("layers run %s%s", "with the fused CPU kernels" if model.cpu_kernels else "in plain torch ops",
             ", decode-sized linears on AMX" if model.amx_linears else "")
    return model


def _kv_bytes(args: argparse.Namespace, device, configs: list, dtype, saved_bytes: int = 0) -> int:
    """Bytes for the KV pool: ``--kv-cache-memory``, else ``--kv-cache-fraction`` of the free
    accelerator memory (a default fraction on cuda/npu), else, on the cpu and the sim, room for
    `CPU_DEFAULT_KV_CONTEXTS` sequences of the longest length accepted, or for
    `CPU_DEFAULT_KV_TOKENS_PER_SEQ` tokens of each of ``--max-num-seqs`` sequences where that is more,
    in the pools of ``configs`` (the model's and the draft model's, or ``None``), at most
    `CPU_MAX_KV_FRACTION` of the memory available, plus ``saved_bytes``, what quantized weights
    save against one dense copy."""
    from stageserve.device.model.kv_cache import available_memory_bytes, bytes_per_block, kv_memory_budget

    if args.kv_cache_memory is not None:
        return args.kv_cache_memory
    if args.kv_cache_fraction is not None or args.backend not in ("cpu", "sim"):
        return kv_memory_budget(device, args.kv_cache_fraction or ACCELERATOR_DEFAULT_KV_FRACTION)
    configs = [c for c in configs if c is not None]
    tokens = max(CPU_DEFAULT_KV_CONTEXTS * (args.max_model_len or min(c.max_position_embeddings for c in configs)),
                 CPU_DEFAULT_KV_TOKENS_PER_SEQ * args.max_num_seqs)
    per_token = sum(bytes_per_block(c, 1, dtype) for c in configs)
    return min(tokens * per_token, int(CPU_MAX_KV_FRACTION * available_memory_bytes("cpu"))) + saved_bytes


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
