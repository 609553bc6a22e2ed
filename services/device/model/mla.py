"""Multi-head latent attention (MLA: DeepSeek-AI 2024, "DeepSeek-V2", §2.1) over a paged pool of latents.

Math as transformers' ``DeepseekV3Attention`` / ``DeepseekV2Attention``: a token's query is
``q_b(norm(q_a(h)))`` (or ``q_proj(h)`` without ``q_lora_rank``), each head's ``qk_nope_head_dim``
values unrotated and ``qk_rope_head_dim`` rotated; ``kv_a_proj_with_mqa(h)`` gives the latent
``c`` (``kv_lora_rank`` values, then ``kv_a_layernorm``) and one rotated key ``k_pe`` shared by every
head; ``kv_b_proj`` expands ``c`` into each head's unrotated key (``W_UK`` [nope, r]) and value
(``W_UV`` [v, r]).

The pool stores ``[c, k_pe]`` per token (``kv_lora_rank + qk_rope_head_dim`` values, for all heads:
``kv_cache.PagedKVCache``), never the expanded keys and values. Attention absorbs the
up-projections (the paper's §2.1.2; vLLM's MLA backend, ``vllm/v1/attention/backends/mla/common.py``,
does the same for decode): ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, so each head's query becomes
``[W_UK^T q_nope, q_pe]`` over the single shared "key" ``[c, k_pe]`` (multi-query attention of
``kv_lora_rank + qk_rope_head_dim`` values per head), and the output is ``W_UV`` times the weighted
sum of the latents, before ``o_proj``. Decode rows and prefills both read the latents: a fresh
prefill its own (SDPA, causal), a later chunk or a prefix-cache hit its whole context from the pool
(SDPA with the chunk's mask). vLLM expands the keys and values for prefills instead (fewer FLOPs
per score when ``qk_nope + qk_rope`` is well below ``kv_lora_rank + qk_rope``); not done here.

Torch ops only (any device); the fused CPU kernels' paged attention does not take this layout, so a
model with MLA runs the torch path (``DecoderModel``). FlashMLA (DeepSeek's CUDA kernel) and
vLLM's ``FlashMLA``/``Triton MLA`` backends would replace `MLAWeights.__call__`'s attention on GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stageserve.device.kernels.quant_linear import QuantizedLinear
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.linear import Linear
from stageserve.device.model.rope import apply_rope

AnyLinear = Linear | QuantizedLinear


@dataclass
class MLAWeights:
    """One layer's latent attention. ``q_a`` [hidden] -> [q_lora_rank] with ``q_a_norm`` [q_lora_rank]
    (both ``None`` without ``q_lora_rank``), ``q_b`` -> [H * (nope + rope)] (``q_proj`` without it);
    ``kv_a`` [hidden] -> [r + rope], ``kv_a_norm`` [r]; ``w_uk`` [H, nope, r] and ``w_uv`` [H, v, r]
    (``kv_b_proj``'s key and value rows per head); ``o`` [H * v] -> [hidden]. Rotated rows in
    rotate-half order (``rope.interleaved_row_order`` applied at load where the checkpoint's pair up)."""

    q_a: AnyLinear | None
    q_a_norm: torch.Tensor | None
    q_b: AnyLinear
    kv_a: AnyLinear
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    o: AnyLinear

    def linears(self) -> list[AnyLinear]:
        """The layer's linears (the up-projections are plain tensors for batched matmuls)."""
        return [lin for lin in (self.q_a, self.q_b, self.kv_a, self.o) if lin is not None]

    def tensors(self) -> list[torch.Tensor]:
        """The norms and up-projections (for memory accounting)."""
        return [t for t in (self.q_a_norm, self.kv_a_norm, self.w_uk, self.w_uv) if t is not None]

    def __call__(
        self, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache,
        scale: float, eps: float, masks: list[torch.Tensor | None], decode_rows: torch.Tensor | None, decode_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer ``index``'s attention of ``h`` [T, hidden] -> [T, hidden]; writes the step's latents into ``kv_cache``.

        ``cos``/``sin`` [T, 1, rope] are the tokens' RoPE rows; ``masks`` the step's
        `attention.prefill_masks`; ``decode_rows`` the decode rows' pool rows (``block_rows``) and
        ``decode_bias`` [Bd, 1 or H, W * block_size] their additive mask (``None`` without decode rows).
        """
        heads, nope, rank = self.w_uk.shape
        q = self.q_b(h if self.q_a is None else F.rms_norm(self.q_a(h), self.q_a_norm.shape, self.q_a_norm, eps)).view(h.shape[0], heads, -1)
        latent = self.kv_a(h)  # [T, r + rope]
        c = F.rms_norm(latent[:, :rank], (rank,), self.kv_a_norm, eps)
        k_pe = apply_rope(latent[:, None, rank:], cos, sin)  # [T, 1, rope]
        latent = torch.cat((c[:, None], k_pe), -1)  # [T, 1, r + rope], what the pool keeps
        kv_cache.write_entries(index, latent, batch.slot_mapping)
        # Absorbed query [T, H, r + rope]: W_UK^T q_nope per head, then the rotated part.
        q_latent = torch.bmm(q[:, :, :nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        query = torch.cat((q_latent, apply_rope(q[:, :, nope:], cos, sin)), -1)
        outputs = []
        if batch.num_decode:
            b = batch.num_decode
            context = kv_cache.gather_rows(index, decode_rows).view(b, -1, latent.shape[-1])  # [Bd, W * block_size, r + rope]
            scores = torch.baddbmm(decode_bias, query[:b], context.transpose(1, 2), alpha=scale)  # [Bd, H, L]
            outputs.append(torch.bmm(scores.softmax(-1), context[:, :, :rank]))  # [Bd, H, r]
        for seg, mask in zip(batch.prefills, masks):
            rows = slice(seg.start, seg.start + seg.length)
            context = latent[rows, 0] if seg.context_slots is None else kv_cache.gather_entries(index, seg.context_slots)[0]  # [L, r + rope]
            out = F.scaled_dot_product_attention(
                query[rows].transpose(0, 1)[None], context[None, None], context[None, None, :, :rank],
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)  # [1, H, n, r]
            outputs.append(out[0].transpose(0, 1))
        out_latent = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # [T, H, r]
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv.transpose(1, 2))  # [H, T, v]
        return self.o(out.transpose(0, 1).reshape(h.shape[0], -1))
