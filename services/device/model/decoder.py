"""The decoder every family runs (``families/``), for batched serving over a paged KV cache.

One forward pass takes a flattened batch mixing prefill chunks and single-token decode rows
(``forward_batch.ForwardBatch``, built once per step by ``forward_batch.build_forward_batch``) and returns the logits of the rows
that sample. The layers are device-generic torch (the same code runs on cpu, cuda and npu tensors),
except that on x86-64 CPUs with AVX-512 they go through the fused C++ ops of ``cpu_kernels``.

Layer math follows the Hugging Face ``LlamaForCausalLM`` reference: RMSNorm (Zhang & Sennrich
2019), rotary position embeddings with rotate-half pairing (Su et al. 2021, "RoFormer"),
grouped-query attention (Ainslie et al. 2023, ``attention.py``) and a SwiGLU MLP (Shazeer 2020),
with the optional parts a family's config turns on: q/k/v biases (``attention_bias``: Qwen2), an
RMSNorm over ``head_dim`` on each query and key head before RoPE (``qk_norm``: Qwen3, Gemma 3), a
sliding attention window on every layer or on some (``sliding_window``, ``full_attention_layers``:
Mistral, Phi-3, Gemma; ``attention.py``) and Gemma's parts: a GeGLU MLP (``hidden_act``), norms on
the attention and MLP outputs (``sandwich_norms``), scaled embeddings (``embed_scale``), a softmax
scale of its own (``attention_scale``), soft-capped attention scores and logits (``attn_softcap``,
``final_softcap``), a RoPE base of the local layers' own (``local_rope_theta``, ``rope.py``) and
a mixture of experts as the MLP (``num_experts``: Qwen3-MoE, Mixtral, DeepSeek; ``moe.py``), and
multi-head latent attention in place of grouped-query attention (``kv_lora_rank``: DeepSeek-V2/V3;
``mla.py``, torch ops only).
When every layer is windowed, prepare releases the blocks the window has left behind (README,
"Sliding window"): their block-table entries point at block 0, which attention reads only under
the window's mask.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from stageserve.device.kernels import cpu_kernels, dense_copies, quant
from stageserve.device.kernels.quant import QuantizedWeight
from stageserve.device.kernels.quant_linear import QuantizedLinear, fits, move_onto_huge_pages
from stageserve.device.model.attention import attention_output, decode_attention, prefill_masks, within_window
from stageserve.device.model.config import ModelConfig
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.fused_decode import FusedDecodeLayers
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.linear import Linear
from stageserve.device.model.mla import MLAWeights
from stageserve.device.model.moe import KernelRouter, MoEMLP
from stageserve.device.model.rope import apply_rope, interleaved_row_order, layer_rope_tables, rotary_row_order
from stageserve.device.model.weights import expected_shapes, load_weights

log = logging.getLogger(__name__)


@dataclass
class LayerWeights:
    """One decoder layer, with q/k/v and gate/up fused so each is a single matmul."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Linear | None  # [hidden] -> [q_size + 2 * kv_size], with Qwen2's bias; None with latent attention
    o: Linear | None  # [q_size] -> [hidden]
    post_norm: torch.Tensor  # [hidden], the MLP's input norm (Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm)
    gate_up: Linear | None  # [hidden] -> [2 * intermediate]; None in a mixture-of-experts layer
    down: Linear | None  # [intermediate] -> [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim], with config.qk_norm (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden], with config.sandwich_norms: Gemma's post_attention_layernorm
    mlp_out_norm: torch.Tensor | None = None  # [hidden], with config.sandwich_norms: post_feedforward_layernorm
    moe: MoEMLP | None = None  # the mixture of experts that is this layer's MLP (config.moe_layers)
    mla: MLAWeights | None = None  # the latent attention that is this layer's attention (config.kv_lora_rank)

    def linears(self) -> list[Linear | QuantizedLinear]:
        """Every linear of the layer (the experts' too)."""
        attention = self.mla.linears() if self.mla is not None else (self.qkv, self.o)
        return [*attention, *(self.moe.linears() if self.moe is not None else (self.gate_up, self.down))]

    def norm_qk_heads_(self, qkv: torch.Tensor, heads: int, kv_heads: int, eps: float, fused: bool = False) -> torch.Tensor:
        """With ``q_norm``/``k_norm``: RMSNorm each query and key head of ``qkv`` [T, (H + 2K) * D] in place
        (before RoPE, as transformers' ``Qwen3Attention``), in one op on the ``fused`` CPU kernels;
        ``qkv`` as it was otherwise. Returns ``qkv``."""
        if self.q_norm is not None and fused:
            cpu_kernels.rms_norm_heads_(qkv, self.q_norm, self.k_norm, heads, kv_heads, eps)
        elif self.q_norm is not None:
            d = self.q_norm.shape[0]
            q = qkv[:, : heads * d].view(-1, heads, d)
            k = qkv[:, heads * d : (heads + kv_heads) * d].view(-1, kv_heads, d)
            q.copy_(F.rms_norm(q, (d,), self.q_norm, eps))
            k.copy_(F.rms_norm(k, (d,), self.k_norm, eps))
        return qkv


class DecoderModel:
    """The decoder's weights on one device and its forward pass (no autograd, no nn.Module hooks)."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor | QuantizedWeight], device: torch.device | str, cpu_kernels_allowed: bool = True,
        amx_allowed: bool = True, weight_format: str = "dequantize", dense_copy: str = "auto",
    ) -> None:
        """Take HF-named ``weights`` (as ``load_weights`` returns them, any float dtype) onto ``device``.

        The activation dtype is the dtype of the float weights (the norms). ``cpu_kernels_allowed``: on
        a CPU, run the layers with the fused C++ ops of ``cpu_kernels`` where they support this CPU,
        dtype and head shape (``self.cpu_kernels`` says whether they do), and with them the bfloat16
        linears of decode-sized inputs on AMX where the CPU has it (``self.amx_linears``;
        ``amx_allowed=False`` keeps them on oneDNN, without the AMX copy of the weights); ``False``
        keeps the pure-torch path (for comparison). ``weight_format`` (``flags.WEIGHT_FORMATS``):
        which linears run on weight-only quantized kernels (CPU only; see `quant.kernel_weight`;
        the VNNI one only with ``cpu_kernels_allowed``, else torch's, `quant_linear.kernel_for`);
        ``self.linear_formats`` counts the linears by the format they run in (``self.unkernelled_formats``: the
        quantized formats dequantized because no kernel on this CPU takes them, logged). ``dense_copy``
        (``auto``, ``all`` or ``none``): which quantized linears also keep one dense copy (AMX-packed where
        the CPU has AMX, else oneDNN's) for inputs of more rows than their kernel takes: ``auto``
        those where it is faster on this CPU (`dense_copies.choose`), oneDNN's within one dense copy
        of the model in all (``self.amx_dense_copies``: the copies are AMX-packed, and all those
        timed faster are kept), ``all`` every one, ``none`` none.
        """
        self.config, self.device = config, torch.device(device)
        self.cpu_kernels_allowed = cpu_kernels_allowed
        self.dtype = weights["model.norm.weight"].dtype
        self.cpu_kernels = (
            cpu_kernels_allowed
            and self.device.type == "cpu"
            and not config.kv_lora_rank  # the fused paged attention does not read latents: MLA runs the torch path (mla.py)
            and cpu_kernels.available(self.dtype, config.head_dim, config.num_heads // config.num_kv_heads)
        )
        amx = self.cpu_kernels and amx_allowed  # decode-sized bf16 linears on AMX where the CPU has it (see Linear)
        self.linear_formats: Counter[str] = Counter()
        self.unkernelled_formats: set[str] = set()  # quantized formats dequantized because no kernel here takes them

        order = rotary_row_order(config)
        if order is not None:  # partial rotary as whole-head RoPE over rearranged q/k rows (see rotary_row_order)
            rotated = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")
            weights = weights | {n: _rows_reordered(t, order) for n, t in weights.items() if n.endswith(rotated)}
        if config.kv_lora_rank and config.rope_interleaved:  # DeepSeek's paired rotated rows, into rotate-half order
            nope, rope, rank = config.qk_nope_head_dim, config.head_dim, config.kv_lora_rank
            q_order = torch.cat([torch.arange(nope), nope + interleaved_row_order(rope)])
            kv_order = torch.cat([torch.arange(rank), rank + interleaved_row_order(rope)])
            weights = weights | {n: _rows_reordered(t, q_order) for n, t in weights.items() if n.endswith(("self_attn.q_proj.weight", "q_b_proj.weight"))}
            weights |= {n: _rows_reordered(t, kv_order) for n, t in weights.items() if n.endswith("kv_a_proj_with_mqa.weight")}

        def w(name: str) -> torch.Tensor:
            return weights[name].to(self.device)

        def linear(names: tuple[str, ...], bias_names: tuple[str, ...] = (), gated: bool = False, dense: bool = False) -> Linear | QuantizedLinear:
            """``dense``: in the activation dtype whatever ``weight_format`` says (a router's)."""
            bias = torch.cat([weights[n] for n in bias_names]).to(self.device) if bias_names else None
            return self._linear([weights[n] for n in names], bias, "dequantize" if dense else weight_format, amx, gated)

        tied = config.tie_word_embeddings
        self.lm_head = linear(("model.embed_tokens.weight" if tied else "lm_head.weight",))
        embed = weights["model.embed_tokens.weight"]
        if tied and isinstance(self.lm_head, QuantizedLinear) and self.lm_head.format == "int8":
            self.embed = self.lm_head  # the tied table is looked up in the head's int8 rows: one copy
        else:  # a tied head is packed separately from the embedding table on CPU (one more vocab x hidden copy)
            self.embed = quant.dequantized(embed).to(self.device, self.dtype)  # [vocab, hidden]
        self.norm = w("model.norm.weight")
        self.layers = [self._layer(i, weights, w, linear) for i in range(config.num_layers)]
        if self.unkernelled_formats:
            log.info("linears of format %s dequantized to %s: no quantized kernel on this CPU takes them (int5 and the K-quants "
                     "but Q4_K need the VNNI kernel: AVX512-VNNI, stageserve's CPU kernels, 16-row panels)",
                     ", ".join(sorted(self.unkernelled_formats)), str(self.dtype).removeprefix("torch."))
        # AMX-packed copies (where the CPU has AMX) ran the many-row inputs 2-4x faster than the
        # kernel (docs/benchmarks.md): there `auto` keeps every copy timed faster, as before; the
        # budget of one dense copy applies to oneDNN's copies (a CPU without AMX).
        self.amx_dense_copies = amx and self.dtype == torch.bfloat16 and cpu_kernels.amx_ready(torch.empty(16, 32, dtype=torch.bfloat16))
        self._keep_dense_copies(dense_copy, budgeted=not self.amx_dense_copies)
        if self.device.type == "cpu":
            move_onto_huge_pages(self.linears_in_step_order())
        self.amx_linears = any(getattr(lin, "amx_weight", None) is not None for layer in self.layers for lin in layer.linears())
        self.rope, self.layer_rope = layer_rope_tables(config, self.dtype, self.device)  # [(cos, signed_sin) [P, D]], an index per layer
        self.layer_windows = config.layer_windows
        self.scale = config.softmax_scale
        # Rounded to the activation dtype first, as transformers' Gemma2TextScaledWordEmbedding does.
        self.embed_scale = None if config.embed_scale is None else float(torch.tensor(config.embed_scale).to(self.dtype))
        self.fused_decode = FusedDecodeLayers.for_model(self)  # decode-only steps' layers in one C++ call, where they fit

    def _layer(self, index: int, weights: dict, w, linear) -> LayerWeights:
        """Decoder layer ``index`` from HF-named ``weights``: ``w`` moves a norm onto the device,
        ``linear`` builds a (fused) linear from weight and bias names (see ``__init__``)."""
        p = f"model.layers.{index}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = tuple(attn + f"{x}_proj." for x in "qkv")
        c = self.config
        # A gated [gate; up] linear runs through `swiglu` (amx_swiglu where packed): SiLU on the fused kernels only.
        qk_norm, sandwich, gated = c.qk_norm, c.sandwich_norms, c.hidden_act == "silu" and self.cpu_kernels
        moe = mla = None
        if c.moe_layers[index]:
            experts = [f"{mlp}experts.{j}." for j in range(c.num_experts)]
            shared = mlp + "shared_experts."
            moe = MoEMLP(
                router=KernelRouter(quant.dequantized(weights[mlp + "gate.weight"]).to(self.dtype)) if self.cpu_kernels
                else linear((mlp + "gate.weight",), dense=True),  # routing stays in the activation dtype
                gate_ups=[linear((e + "gate_proj.weight", e + "up_proj.weight"), gated=gated) for e in experts],
                downs=[linear((e + "down_proj.weight",)) for e in experts], top_k=c.experts_per_token, normalize=c.norm_topk_prob,
                scoring=c.router_scoring, groups=c.expert_groups, groups_kept=c.expert_groups_kept, scale=c.routed_scaling_factor,
                bias=weights[mlp + "gate.e_score_correction_bias"].float().to(self.device) if c.router_scoring == "sigmoid" else None,
                shared=(linear((shared + "gate_proj.weight", shared + "up_proj.weight"), gated=gated), linear((shared + "down_proj.weight",)))
                if c.shared_experts else None)
        if c.kv_lora_rank:
            kv_b = weights[attn + "kv_b_proj.weight"]
            kv_b = quant.dequantized(kv_b).to(self.device, self.dtype)
            kv_b = kv_b.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            lora = c.q_lora_rank is not None
            mla = MLAWeights(
                q_a=linear((attn + "q_a_proj.weight",)) if lora else None, q_a_norm=w(attn + "q_a_layernorm.weight") if lora else None,
                q_b=linear((attn + ("q_b_proj.weight" if lora else "q_proj.weight"),)), kv_a=linear((attn + "kv_a_proj_with_mqa.weight",)),
                kv_a_norm=w(attn + "kv_a_layernorm.weight"), w_uk=kv_b[:, : c.qk_nope_head_dim].contiguous(),
                w_uv=kv_b[:, c.qk_nope_head_dim :].contiguous(), o=linear((attn + "o_proj.weight",)))
        return LayerWeights(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=None if mla else linear(tuple(n + "weight" for n in qkv), tuple(n + "bias" for n in qkv) if self.config.attention_bias else ()),
            o=None if mla else linear((attn + "o_proj.weight",), (attn + "o_proj.bias",) if attn + "o_proj.bias" in weights else ()),
            post_norm=w(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
            gate_up=None if moe else linear((mlp + "gate_proj.weight", mlp + "up_proj.weight"), gated=gated),
            down=None if moe else linear((mlp + "down_proj.weight",)),
            q_norm=w(attn + "q_norm.weight") if qk_norm else None,
            k_norm=w(attn + "k_norm.weight") if qk_norm else None,
            attn_out_norm=w(p + "post_attention_layernorm.weight") if sandwich else None,
            mlp_out_norm=w(p + "post_feedforward_layernorm.weight") if sandwich else None,
            moe=moe,
            mla=mla,
        )

    def _linear(self, parts: list[torch.Tensor | QuantizedWeight], bias: torch.Tensor | None, weight_format: str, amx: bool, gated: bool) -> Linear | QuantizedLinear:
        """One linear over ``parts`` stacked along the output features: on a weight-only kernel where
        ``weight_format`` and the parts allow it (CPU only), else dense in the activation dtype."""
        kernel = quant.kernel_weight(parts, weight_format) if self.device.type == "cpu" else None
        if kernel is not None and not fits(kernel, self.cpu_kernels_allowed):
            self.unkernelled_formats.add(quant.format_name(kernel))
            kernel = None
        if kernel is None:
            self.linear_formats[str(self.dtype).removeprefix("torch.")] += 1
            dense = torch.cat([quant.dequantized(p) for p in parts]).to(self.device, self.dtype)
            return Linear(dense, bias, amx=amx, gated=gated)
        self.linear_formats[quant.format_name(kernel)] += 1

        def dense_copy(weight: torch.Tensor) -> Linear:
            return Linear(weight, bias, amx=amx, gated=gated, one_copy=True)

        return QuantizedLinear(kernel, bias, self.dtype, make_dense=dense_copy, own_kernels=self.cpu_kernels_allowed)

    def linears_in_step_order(self) -> list[Linear | QuantizedLinear]:
        """Every linear in the order a step reads them: the layers', then the head."""
        return [lin for layer in self.layers for lin in layer.linears()] + [self.lm_head]

    def _keep_dense_copies(self, mode: str, budgeted: bool) -> None:
        """Give the quantized linears their dense copies as ``mode`` says (see ``__init__``); with
        ``auto`` and ``budgeted``, within one dense copy of the model in all."""
        quantized = [lin for lin in self.linears_in_step_order() if isinstance(lin, QuantizedLinear)]
        if mode == "all":
            for linear in quantized:
                linear.keep_dense_copy()
        elif mode == "auto" and quantized:
            every_copy = sum(linear.dense_copy_bytes() for linear in quantized)
            budget = self.dense_weight_bytes(self.dtype) - self.weight_bytes() if budgeted else every_copy
            dense_copies.choose(quantized, budget, cache=dense_copies.cache_path(quantized, dense_copies.ROWS))

    def weight_bytes(self) -> int:
        """Bytes the model's weights hold on its device (every copy: oneDNN-packed, AMX-packed, quantized)."""
        held: dict[int, int] = {}

        def add(t: torch.Tensor) -> None:
            if t.is_mkldnn:  # oneDNN's packed layout has no torch storage; its logical size is close (blocking pads little)
                held[id(t)] = t.numel() * t.element_size()
            else:
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

        for lin in self.linears_in_step_order():
            for t in lin.tensors():
                add(t)
        norms = [self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm,
                                                                      layer.attn_out_norm, layer.mlp_out_norm) if t is not None]
        norms += [t for layer in self.layers if layer.mla is not None for t in layer.mla.tensors()]
        norms += [layer.moe.bias for layer in self.layers if layer.moe is not None and layer.moe.bias is not None]
        for t in norms:
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
        weight_format: str = "dequantize", dense_copy: str = "auto",
    ) -> DecoderModel:
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
        return self.logits(batch.sampled_rows(self.hidden_states(batch, kv_cache)))

    @torch.inference_mode()
    def hidden_states(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """The decoder layers of one step (K/V written as in `forward`): ``[T, hidden]`` in the
        activation dtype, before the final norm."""
        return self.layers_of(self.embed_tokens(batch.input_ids), batch, kv_cache)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The (optionally scaled) embeddings ``[T, hidden]`` of ``input_ids`` ``[T]`` int64, in the activation dtype."""
        x = self.embed.embedding(input_ids) if isinstance(self.embed, QuantizedLinear) else F.embedding(input_ids, self.embed)  # [T, hidden]
        return x if self.embed_scale is None else x * self.embed_scale

    @torch.inference_mode()
    def layers_of(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """The decoder layers over inputs ``x`` ``[T, hidden]`` (the embeddings, or what a
        multi-token-prediction module makes of them) at ``batch``'s positions and KV slots:
        ``[T, hidden]``, before the final norm."""
        return self._layers_fused(x, batch, kv_cache) if self.cpu_kernels else self._layers_torch(x, batch, kv_cache)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of hidden states ``[R, hidden]`` (what transformers' ``last_hidden_state`` holds)."""
        return F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, vocab]`` of hidden states ``[S, hidden]`` (before the final norm), soft-capped
        where the model caps them (Gemma 2)."""
        logits = self.lm_head(self.final_norm(x))
        cap = self.config.final_softcap
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _decode_bias(self, batch: ForwardBatch, window: int | None) -> torch.Tensor:
        """The decode rows' additive mask [kv_heads * Bd, q_per_kv, L] (kv-head-major, as the gathered cache) for one window."""
        c = self.config
        b, length = batch.decode_mask.shape
        mask = within_window(batch.decode_mask, batch.positions[:b], window)
        bias = torch.zeros(1, b, 1, length, dtype=self.dtype, device=self.device).masked_fill_(~mask.view(1, b, 1, length), float("-inf"))
        return bias.expand(c.num_kv_heads, b, c.num_heads // c.num_kv_heads, length).reshape(-1, c.num_heads // c.num_kv_heads, length)

    def _layers_torch(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """All decoder layers in plain torch ops (any device): ``x`` [T, hidden] -> [T, hidden]."""
        c, eps, hidden = self.config, self.config.rms_norm_eps, (self.config.hidden_size,)
        rope = [(cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)) for cos, sin in self.rope]  # [T, 1, D] each
        # Masks made once per step for every layer of a window.
        windows = set(self.layer_windows)
        masks = {window: prefill_masks(batch, window) for window in windows}
        decode_bias, decode_rows = {}, None
        if batch.num_decode:
            decode_rows = kv_cache.block_rows(batch.decode_blocks)  # [2 * kv_heads * Bd * W]
            decode_bias = {window: self._decode_bias(batch, window) for window in windows}
        for index, layer in enumerate(self.layers):
            window, (cos, sin) = self.layer_windows[index], rope[self.layer_rope[index]]
            h = F.rms_norm(x, hidden, layer.input_norm, eps)
            if layer.mla is not None:
                attention = layer.mla(index, h, cos, sin, batch, kv_cache, self.scale, eps, masks[window], decode_rows, decode_bias.get(window))
            else:
                attention = self._attention(index, layer, h, cos, sin, batch, kv_cache, masks[window], decode_rows, decode_bias.get(window))
            if layer.attn_out_norm is not None:
                attention = F.rms_norm(attention, hidden, layer.attn_out_norm, eps)
            x = x + attention
            h = F.rms_norm(x, hidden, layer.post_norm, eps)
            mlp = self._mlp(layer, h, fused=False)
            if layer.mlp_out_norm is not None:
                mlp = F.rms_norm(mlp, hidden, layer.mlp_out_norm, eps)
            x = x + mlp
        return x

    def _attention(
        self, index: int, layer: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
        kv_cache: PagedKVCache, masks: list[torch.Tensor | None], decode_rows: torch.Tensor | None, decode_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer ``index``'s grouped-query attention of ``h`` [T, hidden] -> [T, hidden] in torch ops
        (its K/V written into ``kv_cache``); ``cos``/``sin`` [T, 1, D], the masks as `_layers_torch` makes them."""
        c = self.config
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        qkv = layer.norm_qk_heads_(layer.qkv(h), heads, kv_heads, c.rms_norm_eps)  # [T, (H + 2K) * D]
        qk = apply_rope(qkv[:, : (heads + kv_heads) * d].view(-1, heads + kv_heads, d), cos, sin)  # [T, H + K, D]
        v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)  # [T, K, D]
        kv_cache.write(index, qk[:, heads:], v, batch.slot_mapping)
        decode = None
        if batch.num_decode:
            k_context, v_context = kv_cache.gather_blocks(index, decode_rows)  # [K * Bd * W, block_size, D]
            decode = decode_attention(qk[: batch.num_decode, :heads], k_context, v_context, decode_bias, self.scale, c.attn_softcap)
        return layer.o(attention_output(index, decode, qk, v, batch, kv_cache, self.scale, masks, c.attn_softcap))

    def _layers_fused(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """All decoder layers with ``cpu_kernels``' fused ops (CPU): ``x`` [T, hidden] -> [T, hidden].

        Same math as ``_layers_torch``, in fewer passes: RoPE and the KV store in one op, decode
        attention reading the pool in place, each residual add fused into the next RMSNorm
        (``x`` is updated in place), SwiGLU in one op (GeGLU in torch ops), a mixture of experts'
        routing in torch ops around each expert's fused SwiGLU. A decode-only step whose layers
        `FusedDecodeLayers` takes runs these same ops in one C++ call (the same bits).
        """
        if self.fused_decode is not None and self.fused_decode.takes(batch):
            return self.fused_decode(x, batch, kv_cache)
        c, eps = self.config, self.config.rms_norm_eps
        heads, kv_heads, d = c.num_heads, c.num_kv_heads, c.head_dim
        context_lens = batch.positions[: batch.num_decode] + 1  # [Bd] tokens each decode row attends to
        h = cpu_kernels.rms_norm(x, self.layers[0].input_norm, eps)
        masks = {window: prefill_masks(batch, window) for window in set(self.layer_windows)}
        for index, layer in enumerate(self.layers):
            window, (cos, signed_sin) = self.layer_windows[index], self.rope[self.layer_rope[index]]
            qkv, pool = layer.norm_qk_heads_(layer.qkv(h), heads, kv_heads, eps, fused=True), kv_cache.layer(index)  # [T, (H + 2K) * D], [2K, blocks, block_size, D]
            qk = cpu_kernels.rope_and_cache(qkv, cos, signed_sin, batch.positions, pool, batch.slot_mapping, heads)
            v = qkv[:, (heads + kv_heads) * d :].view(-1, kv_heads, d)  # [T, K, D]
            decode = None
            if batch.num_decode:
                decode = cpu_kernels.paged_decode_attention(
                    qk[: batch.num_decode, :heads], pool, batch.decode_blocks, context_lens, self.scale, window, c.attn_softcap)
            attention = layer.o(attention_output(index, decode, qk, v, batch, kv_cache, self.scale, masks[window], c.attn_softcap))
            if layer.attn_out_norm is not None:
                attention = cpu_kernels.rms_norm(attention, layer.attn_out_norm, eps)
            h = cpu_kernels.add_rms_norm(x, attention, layer.post_norm, eps)
            mlp = self._mlp(layer, h, fused=True)
            if layer.mlp_out_norm is not None:
                mlp = cpu_kernels.rms_norm(mlp, layer.mlp_out_norm, eps)
            if index + 1 < len(self.layers):
                h = cpu_kernels.add_rms_norm(x, mlp, self.layers[index + 1].input_norm, eps)
            else:
                x += mlp
        return x

    def _mlp(self, layer: LayerWeights, h: torch.Tensor, fused: bool) -> torch.Tensor:
        """The layer's MLP of ``h`` [T, hidden] -> [T, hidden]: its mixture of experts, else its dense gated MLP."""
        if layer.moe is not None:
            return layer.moe(h, lambda gate_up, down, rows: self._gated_mlp(gate_up, down, rows, fused))
        return self._gated_mlp(layer.gate_up, layer.down, h, fused)

    def _gated_mlp(self, gate_up: Linear | QuantizedLinear, down: Linear | QuantizedLinear, h: torch.Tensor, fused: bool) -> torch.Tensor:
        """``down(act(gate) * up)`` of ``h`` [T, hidden] (Shazeer 2020): SwiGLU for ``silu`` (one op on
        the ``fused`` CPU kernels), GeGLU with tanh-approximated GELU for ``gelu_pytorch_tanh``
        (transformers' ``GELUTanh``, Gemma's ``hidden_activation``)."""
        silu = self.config.hidden_act == "silu"
        if fused and silu:
            return down(gate_up.swiglu(h))
        gate, up = gate_up(h).chunk(2, dim=-1)
        return down((F.silu(gate) if silu else F.gelu(gate, approximate="tanh")) * up)


def _rows_reordered(t: torch.Tensor | QuantizedWeight, order: torch.Tensor) -> torch.Tensor | QuantizedWeight:
    """``t`` [groups * len(order), ...] with each group of rows taken in ``order`` (a quantized
    weight's rows are its rows of blocks)."""
    rows = t.blocks if isinstance(t, QuantizedWeight) else t
    rows = rows.view(-1, order.shape[0], *rows.shape[1:])[:, order].reshape(rows.shape)
    return QuantizedWeight(t.qtype, rows) if isinstance(t, QuantizedWeight) else rows
