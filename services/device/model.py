"""Llama-family decoder (Llama, SmolLM, Qwen2) for batched serving over a paged KV cache.

One forward pass takes a flattened batch mixing prefill chunks and single-token decode rows
(``ForwardBatch``, built once per step by ``build_forward_batch``) and returns the logits of the rows
that sample. The layers are device-generic torch (the same code runs on cpu, cuda and npu tensors),
except that on x86-64 CPUs with AVX-512 they go through the fused C++ ops of ``cpu_kernels``.

Layer math follows the Hugging Face ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` reference:
RMSNorm (Zhang & Sennrich 2019), rotary position embeddings with rotate-half pairing (Su et al.
2021, "RoFormer"), grouped-query attention (Ainslie et al. 2023) and a SwiGLU MLP (Shazeer 2020).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from stageserve.device import cpu_kernels, quant
from stageserve.device.kv_cache import PagedKVCache
from stageserve.device.model_config import ModelConfig
from stageserve.device.quant import QuantizedLinear, QuantizedWeight
from stageserve.device.weights import expected_shapes, load_weights


class BatchRow(NamedTuple):
    """One sequence's part of a step.

    ``token_ids`` are the new tokens (a prefill chunk, or one token when decoding); ``start_pos``
    counts the sequence's tokens already in the KV cache; ``block_table`` lists the KV block ids
    the sequence owns, covering at least ``start_pos + len(token_ids)`` tokens; ``sample`` asks for
    the logits of the row's last token.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclass
class PrefillSegment:
    """Attention inputs of one row with more than one new token.

    The row's tokens are ``ForwardBatch`` tokens ``[start, start + length)``. A row that starts a
    sequence (nothing cached yet) attends to its own new keys with a causal mask and has
    ``context_slots``/``mask`` ``None``; a later chunk reads its whole context back from the cache.
    """

    start: int
    length: int
    context_slots: torch.Tensor | None  # [context] int64 flat KV slots of tokens 0..context-1
    mask: torch.Tensor | None  # [length, context] bool, True where attention is allowed


@dataclass
class ForwardBatch:
    """Inputs of one forward pass, shared by all layers.

    Tokens are ordered with the ``num_decode`` single-token rows first (so decode attention is one
    batched call over ``[0, num_decode)``), then each prefill row's chunk. ``sample_indices`` keeps
    the caller's row order, so logits row ``i`` belongs to the ``i``-th row that asked to sample.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat KV slot (block_id * block_size + offset) each new K/V is written to
    num_decode: int
    decode_blocks: torch.Tensor | None  # [num_decode, W] int64 block tables of the decode rows, cut to the longest context's W blocks, padded
    decode_mask: torch.Tensor | None  # [num_decode, W * block_size] bool, True for the row's real context tokens
    prefills: list[PrefillSegment]
    sample_indices: torch.Tensor  # [S] int64 index into T of each sampling row's last token

    def to(self, device: torch.device | str) -> ForwardBatch:
        """A copy with every tensor on ``device`` (non-blocking where the source is pinned)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return ForwardBatch(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            num_decode=self.num_decode,
            decode_blocks=move(self.decode_blocks),
            decode_mask=move(self.decode_mask),
            prefills=[PrefillSegment(p.start, p.length, move(p.context_slots), move(p.mask)) for p in self.prefills],
            sample_indices=move(self.sample_indices),
        )


def build_forward_batch(rows: list[BatchRow] | list[tuple], block_size: int, device: torch.device | str) -> ForwardBatch:
    """Build the step's ``ForwardBatch`` on the host from ``(token_ids, start_pos, block_table, sample)`` rows, then move it to ``device``.

    Raises ``ValueError`` for a row with no new tokens or a block table too short for its context.
    """
    rows = [BatchRow(*row) for row in rows]
    for i, row in enumerate(rows):
        if not row.token_ids:
            raise ValueError(f"row {i} has no new tokens")
        if len(row.block_table) * block_size < row.start_pos + len(row.token_ids):
            raise ValueError(f"row {i}: block table of {len(row.block_table)} blocks cannot hold {row.start_pos + len(row.token_ids)} tokens")
    order = [i for i, r in enumerate(rows) if len(r.token_ids) == 1] + [i for i, r in enumerate(rows) if len(r.token_ids) > 1]
    num_decode = sum(len(r.token_ids) == 1 for r in rows)

    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slot_mapping: list[torch.Tensor] = []
    last_token = [0] * len(rows)
    decode_blocks = decode_mask = None
    if num_decode:
        decode = [rows[i] for i in order[:num_decode]]
        context = [r.start_pos + 1 for r in decode]
        width = -(-max(context) // block_size)
        decode_blocks = _pad_tables([r.block_table[:width] for r in decode], width)  # [Bd, W]
        position = torch.tensor(context) - 1  # [Bd]
        decode_mask = torch.arange(width * block_size) <= position[:, None]  # [Bd, W * block_size]
        input_ids += [r.token_ids[0] for r in decode]
        positions.append(position)
        slot_mapping.append(decode_blocks.gather(1, (position // block_size)[:, None]).view(-1) * block_size + position % block_size)
        for t, i in enumerate(order[:num_decode]):
            last_token[i] = t
    prefills = []
    for i in order[num_decode:]:
        row, start = rows[i], len(input_ids)
        n, context = len(row.token_ids), row.start_pos + len(row.token_ids)
        j = torch.arange(context)
        slots = torch.tensor(row.block_table)[j // block_size] * block_size + j % block_size  # [context]
        pos = j[row.start_pos :]  # [n]
        fresh = row.start_pos == 0
        prefills.append(PrefillSegment(start, n, None if fresh else slots, None if fresh else j <= pos[:, None]))
        input_ids += row.token_ids
        positions.append(pos)
        slot_mapping.append(slots[row.start_pos :])
        last_token[i] = start + n - 1
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(slot_mapping),
        num_decode=num_decode,
        decode_blocks=decode_blocks,
        decode_mask=decode_mask,
        prefills=prefills,
        sample_indices=torch.tensor([last_token[i] for i, r in enumerate(rows) if r.sample], dtype=torch.int64),
    )
    return batch if torch.device(device).type == "cpu" else batch.to(device)


def _pad_tables(tables: list[list[int]], width: int) -> torch.Tensor:
    """Block tables of at most ``width`` blocks -> [rows, width] int64, padded with block 0 (read only under a mask)."""
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


# ---- rotary embeddings ------------------------------------------------------------------------


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies ``[head_dim // 2]`` float32, the cos/sin scale, and the table length.

    Base RoPE: ``theta ** (-2i / d)`` (Su et al. 2021). Scaling variants follow transformers'
    ``modeling_rope_utils``: ``linear`` (divide by ``factor``, kaiokendev), ``llama3`` (Meta's
    smooth low/high-frequency blend, ``_compute_llama3_parameters``), ``yarn`` (Peng et al. 2023,
    ``_compute_yarn_parameters``, incl. its attention factor). ``dynamic`` NTK is applied as one
    static table for ``max_position_embeddings * factor`` positions with the NTK-enlarged base,
    as vLLM does, because a paged cache cannot re-rotate keys already stored when a sequence grows.
    llama.cpp's ``rope_freqs`` (``config.rope_freq_factors``) divide the frequencies.
    """
    dim, base, length = config.head_dim, config.rope_theta, config.max_position_embeddings
    scaling = config.rope_scaling or {"rope_type": "default"}
    kind, attention_factor = scaling["rope_type"], 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        length = int(length * factor)
        base = base * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponent)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base**exponent, scaling, config)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, attention_factor, length


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(pos_freqs: torch.Tensor, s: dict, config: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
    old_len = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and signed ``sin`` tables ``[positions, head_dim]`` of ``dtype``.

    Angles are computed in float32 (as transformers does) and cast. The sine table's first half is
    negated so ``rotate_half(x) * sin == x.roll(head_dim // 2, -1) * signed_sin``: one roll instead
    of a split, a negation and a concatenation per layer.
    """
    inv_freq, attention_factor, length = rope_inv_freq(config)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # [P, D/2]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by per-token ``cos``/``signed_sin`` ``[T, 1, D]``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


# ---- model ------------------------------------------------------------------------------------


class Linear:
    """``y = x @ weight.T + bias``: ``x`` [..., in] -> [..., out], with the weight held in its device's fastest layout.

    On a CPU with oneDNN, float32 and (where oneDNN supports it) bfloat16 weights are reordered once
    into oneDNN's blocked layout and run through ``torch.ops.mkldnn._linear_pointwise`` (the packed
    linear torch.compile's inductor emits on CPU). Measured on a 2-core AVX-512 CPU (torch 2.13),
    the model's matmuls at 1-64 rows ran 1.5-2.8x faster in bfloat16 and 3.7-4.4x faster in float32
    (where ``F.linear`` goes to MKL's sgemm) than through ``F.linear``. Everywhere else: ``F.linear``.

    ``amx``: also keep an AMX-packed copy (``cpu_kernels.amx_pack``, where ``cpu_kernels.amx_ready``)
    for inputs of at most ``AMX_MAX_ROWS`` rows, a decode step's: ``cpu_kernels.amx_linear`` runs them
    ~20 % faster than oneDNN, at the cost of a second copy of the weight. ``gated``: the weight is
    SwiGLU's ``[gate; up]``, packed for ``swiglu``, which then runs on ``cpu_kernels.amx_swiglu``.
    ``one_copy``: where the AMX copy is made, keep no other: larger inputs run on it 64 rows at a time
    (the dense companion of a quantized linear, see ``quant.QuantizedLinear``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, amx: bool = False, gated: bool = False, one_copy: bool = False) -> None:
        """``weight`` [out, in] and ``bias`` [out] already on their device, same dtype."""
        self.bias, self.gated = bias, gated
        self.amx_weight = None
        if amx and cpu_kernels.amx_ready(weight, gated) and not (gated and bias is not None):  # amx_swiglu takes no bias
            self.amx_weight = (cpu_kernels.amx_pack_gated if gated else cpu_kernels.amx_pack)(weight)
        self.amx_only = one_copy and self.amx_weight is not None
        self.packed = _can_pack(weight) and not self.amx_only
        self.weight = None if self.amx_only else torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this linear holds (for memory accounting)."""
        return [t for t in (self.weight, self.amx_weight, self.bias) if t is not None]

    def _on_amx(self, x: torch.Tensor) -> bool:
        return self.amx_weight is not None and x.dim() == 2 and (x.shape[0] <= cpu_kernels.AMX_MAX_ROWS or self.amx_only)

    def _amx_rows(self, op, x: torch.Tensor, *extra) -> torch.Tensor:
        """``op(x, amx_weight, *extra)`` over ``x`` [T, in] in slices of at most ``AMX_MAX_ROWS`` rows."""
        rows = cpu_kernels.AMX_MAX_ROWS
        if x.shape[0] <= rows:
            return op(x, self.amx_weight, *extra)
        return torch.cat([op(x[i : i + rows], self.amx_weight, *extra) for i in range(0, x.shape[0], rows)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] -> [..., out], in ``x``'s dtype."""
        if not self.gated and self._on_amx(x):
            return self._amx_rows(cpu_kernels.amx_linear, x, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection of ``x`` [T, in] -> [T, out / 2] (CPU kernels only)."""
        if self._on_amx(x):
            return self._amx_rows(cpu_kernels.amx_swiglu, x)
        return cpu_kernels.silu_and_mul(self(x))


def _can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take oneDNN's packed linear path (CPU, oneDNN built in, a dtype it runs natively)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single matmul."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] -> [q_size + 2 * kv_size], with Qwen2's bias
    o: Linear  # [q_size] -> [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] -> [2 * intermediate]
    down: Linear  # [intermediate] -> [hidden]


class LlamaModel:
    """The decoder's weights on one device and its forward pass (no autograd, no nn.Module hooks)."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight], device: torch.device | str, cpu_kernels_allowed: bool = True,
        amx_allowed: bool = True, weight_format: str = "dequantize", dense_copy: bool = True,
    ) -> None:
        """Take HF-named ``weights`` (as ``load_weights`` returns them, any float dtype) onto ``device``.

        The activation dtype is the dtype of the float weights (the norms). ``cpu_kernels_allowed``: on
        a CPU, run the layers with the fused C++ ops of ``cpu_kernels`` where they support this CPU,
        dtype and head shape (``self.cpu_kernels`` says whether they do), and with them the bfloat16
        linears of decode-sized inputs on AMX where the CPU has it (``self.amx_linears``;
        ``amx_allowed=False`` keeps them on oneDNN, without the AMX copy of the weights); ``False``
        keeps the pure-torch path (for comparison). ``weight_format`` (``quant.WEIGHT_FORMATS``):
        which linears run on weight-only int4/int8 kernels (CPU only; see `quant.kernel_weight`);
        ``self.linear_formats`` counts the linears by the format they run in. ``dense_copy``: a
        quantized linear also keeps one dense copy (AMX-packed where the CPU has AMX, else oneDNN's)
        for inputs of more rows than its kernel wins at; ``False`` dequantizes per call instead.
        """
        self.config, self.device, self.dense_copy = config, torch.device(device), dense_copy
        self.dtype = weights["model.norm.weight"].dtype
        self.cpu_kernels = (
            cpu_kernels_allowed
            and self.device.type == "cpu"
            and cpu_kernels.available(self.dtype, config.head_dim, config.num_heads // config.num_kv_heads)
        )
        amx = self.cpu_kernels and amx_allowed  # decode-sized bf16 linears on AMX where the CPU has it (see Linear)
        self.linear_formats: Counter[str] = Counter()

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device)

        def linear(names: tuple[str, ...], bias_names: tuple[str, ...] = (), gated: bool = False) -> Linear | QuantizedLinear:
            bias = torch.cat([weights[n] for n in bias_names]).to(self.device) if bias_names else None
            return self._linear([weights[n] for n in names], bias, weight_format, amx, gated)

        tied = config.tie_word_embeddings
        self.lm_head = linear(("model.embed_tokens.weight" if tied else "lm_head.weight",))
        embed = weights["model.embed_tokens.weight"]
        if tied and isinstance(self.lm_head, QuantizedLinear) and not self.lm_head.int4:
            self.embed = self.lm_head  # the tied table is looked up in the head's int8 rows: one copy
        else:  # a tied head is packed separately from the embedding table on CPU (one more vocab x hidden copy)
            self.embed = (embed.dequantize() if isinstance(embed, QuantizedWeight) else embed).to(self.device, self.dtype)  # [vocab, hidden]
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = tuple(attn + f"{x}_proj." for x in "qkv")
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=linear(tuple(n + "weight" for n in qkv), tuple(n + "bias" for n in qkv) if config.attention_bias else ()),
                o=linear((attn + "o_proj.weight",), (attn + "o_proj.bias",) if attn + "o_proj.bias" in weights else ()),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=linear((mlp + "gate_proj.weight", mlp + "up_proj.weight"), gated=True),
                down=linear((mlp + "down_proj.weight",)),
            ))
        self.amx_linears = any(getattr(lin, "amx_weight", None) is not None for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        self.cos, self.signed_sin = rope_tables(config, self.dtype, self.device)
        self.scale = config.head_dim**-0.5

    def _linear(self, parts: list[torch.Tensor | QuantizedWeight], bias: torch.Tensor | None, weight_format: str, amx: bool, gated: bool) -> Linear | QuantizedLinear:
        """One linear over ``parts`` stacked along the output features: on a weight-only kernel where
        ``weight_format`` and the parts allow it (CPU only), else dense in the activation dtype."""
        kernel = quant.kernel_weight(parts, weight_format) if self.device.type == "cpu" else None
        dense = None
        if kernel is None or self.dense_copy:
            dense = torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in parts]).to(self.device, self.dtype)
        if kernel is None:
            self.linear_formats[str(self.dtype).removeprefix("torch.")] += 1
            return Linear(dense, bias, amx=amx, gated=gated)
        self.linear_formats[quant.format_name(kernel)] += 1
        return QuantizedLinear(kernel, bias, self.dtype, dense=None if dense is None else Linear(dense, bias, amx=amx, gated=gated, one_copy=True))

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold on its device (every copy: oneDNN-packed, AMX-packed, quantized)."""
        held: dict[int, int] = {}

        def add(t: torch.Tensor) -> None:
            if t.is_mkldnn:  # oneDNN's packed layout has no torch storage; its logical size is close (blocking pads little)
                held[id(t)] = t.numel() * t.element_size()
            else:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        linears = [self.lm_head] + [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for lin in linears:
            for t in lin.tensors():
                add(t)
        for t in [self.norm, *(layer.input_norm for layer in self.layers), *(layer.post_norm for layer in self.layers)]:
            add(t)
        if isinstance(self.embed, torch.Tensor):
            add(self.embed)
        return sum(held.values())

    def dense_weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one copy of every weight in ``dtype`` (what the dequantizing path loads, before any packing)."""
        return sum(math.prod(shape) for shape in expected_shapes(self.config).values()) * dtype.itemsize

    @classmethod
    def from_path(
        cls, path: Path, dtype: torch.dtype, device: torch.device | str, cpu_kernels_allowed: bool = True, amx_allowed: bool = True,
        weight_format: str = "dequantize", dense_copy: bool = True,
    ) -> LlamaModel:
        """Load a GGUF file or HF directory (see ``load_weights``; raises ``ModelLoadError``); the options as in ``__init__``."""
        config, weights = load_weights(path, dtype, keep_quantized=weight_format != "dequantize")
        return cls(config, weights, device, cpu_kernels_allowed, amx_allowed, weight_format, dense_copy)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into ``kv_cache``, return logits ``[S, vocab]`` in the
        activation dtype (no float32 copy: greedy sampling reads them as they are, see ``sample``).

        ``batch`` must already be on this model's device. Rows read only the cache slots their
        block tables name.
        """
        c = self.config
        x = self.embed.embedding(batch.input_ids) if isinstance(self.embed, QuantizedLinear) else F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        x = self._layers_fused(x, batch, kv_cache) if self.cpu_kernels else self._layers_torch(x, batch, kv_cache)
        x = F.rms_norm(x[batch.sample_indices], (c.hidden_size,), self.norm, c.rms_norm_eps)  # [S, hidden]
        return self.lm_head(x)

    def _layers_torch(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """All decoder layers in plain torch ops (any device): ``x`` [T, hidden] -> [T, hidden]."""
        c = self.config
        cos = self.cos[batch.positions].unsqueeze(1)  # [T, 1, D]
        sin = self.signed_sin[batch.positions].unsqueeze(1)
        decode_bias = decode_rows = None
        if batch.num_decode:
            decode_rows = kv_cache.block_rows(batch.decode_blocks)  # [2 * kv_heads * Bd * W]
            # Additive mask [kv_heads * Bd, q_per_kv, L] (kv-head-major, as the gathered cache), made once per step for every layer.
            b, length = batch.decode_mask.shape
            bias = torch.zeros(1, b, 1, length, dtype=self.dtype, device=self.device).masked_fill_(~batch.decode_mask.view(1, b, 1, length), float("-inf"))
            decode_bias = bias.expand(c.num_kv_heads, b, c.num_heads // c.num_kv_heads, length).reshape(-1, c.num_heads // c.num_kv_heads, length)
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        for index, layer in enumerate(self.layers):
            h = F.rms_norm(x, (c.hidden_size,), layer.input_norm, c.rms_norm_eps)
            qkv = layer.qkv(h)  # [T, (H + 2K) * D]
            qk = apply_rope(qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d), cos, sin)  # [T, H + K, D]
            v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)  # [T, K, D]
            kv_cache.write(index, qk[:, heads:], v, batch.slot_mapping)
            decode = None
            if batch.num_decode:
                k_context, v_context = kv_cache.gather_blocks(index, decode_rows)  # [K * Bd * W, block_size, D]
                decode = self._decode_attention(qk[: batch.num_decode, :heads], k_context, v_context, decode_bias)
            x = x + layer.o(self._attention_output(index, decode, qk, v, batch, kv_cache))
            h = F.rms_norm(x, (c.hidden_size,), layer.post_norm, c.rms_norm_eps)
            x = x + layer.down(_swiglu(layer.gate_up(h), c.intermediate_size))
        return x

    def _layers_fused(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """All decoder layers with ``cpu_kernels``' fused ops (CPU): ``x`` [T, hidden] -> [T, hidden].

        Same math as ``_layers_torch``, in fewer passes: RoPE and the KV store in one op, decode
        attention reading the pool in place, each residual add fused into the next RMSNorm
        (``x`` is updated in place), SwiGLU in one op.
        """
        c, eps = self.config, self.config.rms_norm_eps
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        context_lens = batch.positions[: batch.num_decode] + 1  # [Bd] tokens each decode row attends to
        h = cpu_kernels.rms_norm(x, self.layers[0].input_norm, eps)
        for index, layer in enumerate(self.layers):
            qkv, pool = layer.qkv(h), kv_cache.layer(index)  # [T, (H + 2K) * D], [2K, blocks, block_size, D]
            qk = cpu_kernels.rope_and_cache(qkv, self.cos, self.signed_sin, batch.positions, pool, batch.slot_mapping, heads)
            v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)  # [T, K, D]
            decode = None
            if batch.num_decode:
                decode = cpu_kernels.paged_decode_attention(qk[: batch.num_decode, :heads], pool, batch.decode_blocks, context_lens, self.scale)
            h = cpu_kernels.add_rms_norm(x, layer.o(self._attention_output(index, decode, qk, v, batch, kv_cache)), layer.post_norm, eps)
            mlp = layer.down(layer.gate_up.swiglu(h))
            if index + 1 < len(self.layers):
                h = cpu_kernels.add_rms_norm(x, mlp, self.layers[index + 1].input_norm, eps)
            else:
                x += mlp
        return x

    def _attention_output(
        self, index: int, decode: torch.Tensor | None, qk: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """Attention output ``[T, q_size]`` of one layer: the decode rows' ``decode`` ([Bd, q_size], or
        ``None`` without decode rows) followed by each prefill row's causal attention.

        ``qk`` [T, H + K, D] are the rotated query and key heads, ``v`` [T, K, D] the values; this
        step's keys and values are already in ``kv_cache``. Consecutive fresh prefills of one length
        (a burst of same-length prompts) go through one batched call instead of one call each.
        """
        heads = self.config.num_heads
        outputs = [] if decode is None else [decode]
        segments, i = batch.prefills, 0
        while i < len(segments):
            seg = segments[i]
            if seg.context_slots is None:
                j = i + 1
                while j < len(segments) and segments[j].context_slots is None and segments[j].length == seg.length:
                    j += 1
                rows = slice(seg.start, seg.start + (j - i) * seg.length)
                outputs.append(self._fresh_prefill_attention(qk[rows], v[rows], j - i))
                i = j
                continue
            rows = slice(seg.start, seg.start + seg.length)
            k_context, v_context = kv_cache.gather_slots(index, seg.context_slots)  # [K, context, D]
            outputs.append(self._prefill_attention(qk[rows, :heads], k_context, v_context, seg.mask))
            i += 1
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Single-query attention of ``q`` [B, H, D] over each row's cached context -> [B, H * D].

        ``k``/``v`` [K * B * W, block_size, D] are the rows' W context blocks per KV head, kv-head-major
        (``PagedKVCache.gather_blocks``); ``bias`` [K * B, H / K, W * block_size] is the additive mask.
        Uses baddbmm/softmax/bmm with each KV head's query group as a tiny batch: on CPU this is
        about twice as fast as ``scaled_dot_product_attention`` for one query per row (measured on
        torch 2.13, bf16 and fp32), and it needs no GQA key repetition.
        """
        b, heads, d = q.shape
        kv_heads, length = bias.shape[0] // b, bias.shape[2]
        group = heads // kv_heads
        k, v = k.view(kv_heads * b, length, d), v.view(kv_heads * b, length, d)
        q = q.view(b, kv_heads, group, d).transpose(0, 1).reshape(kv_heads * b, group, d)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=self.scale)  # [K*B, G, L]
        out = torch.bmm(scores.softmax(-1), v)  # [K*B, G, D]
        return out.view(kv_heads, b, group * d).transpose(0, 1).reshape(b, -1)

    def _fresh_prefill_attention(self, qk: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
        """Causal self-attention of ``rows`` fresh prefills of n tokens each, laid end to end:
        ``qk`` [rows * n, H + K, D] and ``v`` [rows * n, K, D] -> [rows * n, H * D].

        One 4-D SDPA call over the batch of rows (on CPU only 4-D inputs reach SDPA's flash kernel;
        3-D ones take the math path that materialises the scores, measured 6x slower at 2048 tokens).
        """
        heads, kv_heads, d = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        n = qk.shape[0] // rows
        q = qk[:, :heads].view(rows, n, heads, d).transpose(1, 2)  # [rows, H, n, D]
        k = qk[:, heads:].view(rows, n, kv_heads, d).transpose(1, 2)  # [rows, K, n, D]
        out = F.scaled_dot_product_attention(q, k, v.view(rows, n, kv_heads, d).transpose(1, 2), is_causal=True, scale=self.scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(rows * n, heads * d)

    def _prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of one later prefill chunk: ``q`` [n, H, D] over its context ``k``/``v`` [K, context, D]
        with ``mask`` [n, context] bool -> [n, H * D] (4-D inputs, for SDPA's flash kernel)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=self.scale, enable_gqa=True,
        )  # [1, H, n, D]
        return out[0].transpose(0, 1).reshape(q.shape[0], -1)


def _swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` from the fused ``[T, 2 * intermediate]`` projection."""
    return F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
