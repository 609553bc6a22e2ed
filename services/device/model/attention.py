"""Grouped-query attention (Ainslie et al. 2023) over the paged KV pool, as every family runs it in plain torch ops.

A step's rows come as the decode rows (one query each, over their cached blocks) followed by
prefill chunks (causal, over their context); ``scale`` is the softmax scale (``ModelConfig.softmax_scale``).
A sliding ``window`` (a layer's ``ModelConfig.layer_windows``, ``None`` for none) keeps each query to the keys
at positions ``q - window < k <= q`` (transformers' ``sliding_window_overlay``, ``masking_utils.py``).
A ``softcap`` (Gemma 2's ``attn_logit_softcapping``, ``None`` for none) turns each scaled score s into
``softcap * tanh(s / softcap)`` before the mask (transformers' ``eager_attention_forward``); SDPA has
no such option, so capped prefills take ``softcapped_attention``.
The fused CPU path (``kernels/cpu_kernels.paged_decode_attention``) replaces only the decode part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.kv_cache import PagedKVCache


def prefill_masks(batch: ForwardBatch, window: int | None) -> list[torch.Tensor | None]:
    """Per prefill segment of ``batch``, the mask its attention takes, made once per step for every
    layer: a later chunk's ``seg.mask`` [n, context] bool narrowed to the ``window``; a fresh
    prefill's [n, n] bool causal window where the window is shorter than n, else ``None`` (SDPA's
    own causal mask)."""
    masks: list[torch.Tensor | None] = []
    for seg in batch.prefills:
        if seg.context_slots is not None:
            masks.append(within_window(seg.mask, batch.positions[seg.start : seg.start + seg.length], window))
        elif window is not None and window < seg.length:
            position = torch.arange(seg.length, device=batch.positions.device)
            masks.append(within_window(position <= position[:, None], position, window))
        else:
            masks.append(None)
    return masks


def attention_output(
    index: int, decode: torch.Tensor | None, qk: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache, scale: float,
    masks: list[torch.Tensor | None], softcap: float | None = None,
) -> torch.Tensor:
    """Attention output ``[T, q_size]`` of one layer: the decode rows' ``decode`` ([Bd, q_size], or
    ``None`` without decode rows) followed by each prefill row's causal attention.

    ``qk`` [T, H + K, D] are the rotated query and key heads, ``v`` [T, K, D] the values; this
    step's keys and values are already in ``kv_cache``; ``masks`` are the step's `prefill_masks`
    for this layer's window, ``softcap`` the layer's score cap.
    Consecutive fresh prefills of one length (a burst of same-length prompts) go through one
    batched call instead of one call each.
    """
    heads = qk.shape[1] - v.shape[1]
    outputs = [] if decode is None else [decode]
    segments, i = batch.prefills, 0
    while i < len(segments):
        seg = segments[i]
        if seg.context_slots is None:
            j = i + 1
            while j < len(segments) and segments[j].context_slots is None and segments[j].length == seg.length:
                j += 1
            rows = slice(seg.start, seg.start + (j - i) * seg.length)
            outputs.append(fresh_prefill_attention(qk[rows], v[rows], j - i, scale, masks[i], softcap))
            i = j
            continue
        rows = slice(seg.start, seg.start + seg.length)
        k_context, v_context = kv_cache.gather_slots(index, seg.context_slots)  # [K, context, D]
        outputs.append(prefill_attention(qk[rows, :heads], k_context, v_context, masks[i], scale, softcap))
        i += 1
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def within_window(mask: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """``mask`` [R, L] bool (key ``j`` is the sequence's position ``j``) also false where key ``j`` is at
    or before ``positions`` [R] int64 (each query's position) minus ``window``; ``mask`` itself without a window."""
    if window is None:
        return mask
    return mask & (torch.arange(mask.shape[1], device=mask.device) > positions[:, None] - window)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
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
    if softcap is None:
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale)  # [K*B, G, L]
    else:
        scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale / softcap).tanh_().mul_(softcap).add_(bias)
    out = torch.bmm(scores.softmax(-1), v)  # [K*B, G, D]
    return out.view(kv_heads, b, group * d).transpose(0, 1).reshape(b, -1)


def fresh_prefill_attention(
    qk: torch.Tensor, v: torch.Tensor, rows: int, scale: float, mask: torch.Tensor | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal self-attention of ``rows`` fresh prefills of n tokens each, laid end to end:
    ``qk`` [rows * n, H + K, D] and ``v`` [rows * n, K, D] -> [rows * n, H * D]; with ``mask`` [n, n]
    bool (a sliding window's, `prefill_masks`) instead of the plain causal one; with ``softcap``
    through `softcapped_attention`.

    One 4-D SDPA call over the batch of rows (on CPU only 4-D inputs reach SDPA's flash kernel;
    3-D ones take the math path that materialises the scores, measured 6x slower at 2048 tokens).
    """
    kv_heads, d = v.shape[1], v.shape[2]
    heads = qk.shape[1] - kv_heads
    n = qk.shape[0] // rows
    q = qk[:, :heads].view(rows, n, heads, d).transpose(1, 2)  # [rows, H, n, D]
    k = qk[:, heads:].view(rows, n, kv_heads, d).transpose(1, 2)  # [rows, K, n, D]
    v = v.view(rows, n, kv_heads, d).transpose(1, 2)
    if softcap is not None:
        out = softcapped_attention(q, k, v, mask, scale, softcap)
    elif mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * n, heads * d)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one later prefill chunk: ``q`` [n, H, D] over its context ``k``/``v`` [K, context, D]
    with ``mask`` [n, context] bool -> [n, H * D] (4-D inputs, for SDPA's flash kernel; with
    ``softcap`` through `softcapped_attention`)."""
    if softcap is not None:
        out = softcapped_attention(q.transpose(0, 1)[None], k[None], v[None], mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True,
        )  # [1, H, n, D]
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


SOFTCAP_QUERY_ROWS = 256
"""Query rows per pass of `softcapped_attention`: its fp32 scores [B, H, rows, L] are materialised,
so a long prompt goes in slices rather than as one [H, n, n] block."""


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float) -> torch.Tensor:
    """Grouped-query attention with soft-capped scores: ``q`` [B, H, n, D] over ``k``/``v`` [B, K, L, D]
    -> [B, H, n, D], query head h reading kv head ``h // (H / K)``.

    transformers' ``eager_attention_forward`` (``modeling_gemma2.py``): scores ``q . k * scale``,
    then ``softcap * tanh(scores / softcap)``, then the mask (``mask`` [n, L] bool; ``None``: causal
    with the n queries the last n of the L keys), softmax in float32, weights in ``q``'s dtype.
    """
    b, heads, n, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril_(length - n)
    out = torch.empty_like(q)
    for start in range(0, n, SOFTCAP_QUERY_ROWS):
        rows = slice(start, min(start + SOFTCAP_QUERY_ROWS, n))
        m = rows.stop - rows.start
        grouped = q[:, :, rows].reshape(b, kv_heads, group * m, d)  # each kv head's query group as one matrix
        scores = torch.matmul(grouped, k.transpose(-1, -2)).view(b, heads, m, length)
        scores = scores.mul_(scale / softcap).tanh_().mul_(softcap).masked_fill_(~mask[rows], float("-inf"))
        weights = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(b, kv_heads, group * m, length)
        out[:, :, rows] = torch.matmul(weights, v).view(b, heads, m, d)
    return out
