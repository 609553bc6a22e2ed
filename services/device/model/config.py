"""Architecture hyper-parameters of a decoder-only model, read from GGUF metadata or an HF config.json.

Only what the device's forward pass needs is kept. What is common to every family is read here;
which family a file is, and what that family adds, comes from the registry (``family.py``, one
module per family in ``families/``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stageserve.device.model.family import Unsupported, family_for_gguf, family_for_hf, gguf_architectures, hf_model_types

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # transformers' ACT2FN names: SwiGLU, GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' layer_types values


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and what is wrong."""


GGUF_POOLING = {0: "last", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
"""llama.cpp's ``{arch}.pooling_type`` (``enum llama_pooling_type``) -> pooling; NONE (a generative
model) embeds by its last token, as a missing key does (vLLM's default for a causal LM)."""
_ST_POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls",
                     "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                     "pooling_mode_weightedmean_tokens": "weightedmean"}


def pooling_of_hf(directory: Path) -> str:
    """The pooling a sentence-transformers directory names (``modules.json``'s
    ``sentence_transformers.models.Pooling`` module, its ``config.json``: the first mode set); ``last``
    for a plain transformers checkpoint. Raises ``ModelLoadError`` for unreadable JSON."""
    import json

    def read(path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: unreadable ({exc})") from None

    if not (directory / "modules.json").is_file():
        return "last"
    for module in read(directory / "modules.json"):
        if module.get("type", "").endswith(".Pooling") and (directory / module.get("path", "") / "config.json").is_file():
            modes = read(directory / module["path"] / "config.json")
            return next((name for key, name in _ST_POOLING_MODES.items() if modes.get(key)), "last")
    return "last"


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer of one of the registered families.

    ``rope_scaling`` follows the Hugging Face ``rope_parameters`` dict (``rope_type`` plus that
    type's keys, e.g. ``factor``), or is ``None`` for plain RoPE. ``rope_freq_factors`` holds
    llama.cpp's ``rope_freqs.weight`` (per-frequency divisors, ``head_dim // 2`` values) that GGUF
    converters write instead of llama3 scaling parameters. ``attention_bias``: the q/k/v projections
    have biases (o_proj's is loaded where the checkpoint has one); ``qk_norm``: an RMSNorm over
    ``head_dim`` on every query and key head before RoPE (Qwen3's ``q_norm``/``k_norm``).
    ``sliding_window``: in every layer but the ``full_attention_layers`` a query at position p attends
    only to keys at positions ``p - sliding_window < k <= p`` (transformers' ``sliding_window_overlay``
    in ``masking_utils.py``: the window counts the current token), ``None`` for full causal attention
    (Mistral, Phi-3, Gemma's local layers; ``layer_windows`` says each layer's).
    ``rotary_dim``: RoPE rotates only the first ``rotary_dim`` values of each head
    (``partial_rotary_factor * head_dim``, Phi-3/Phi-4-mini), ``None`` for the whole head.
    ``pooling``: how an embedding pools the last hidden states: ``mean`` or ``last`` (`pooling_of_hf`,
    `GGUF_POOLING`); another mode's name where the model's files ask for one the device lacks.

    Gemma 2 / Gemma 3: ``hidden_act`` the gated MLP's activation (``SUPPORTED_ACTIVATIONS``);
    ``sandwich_norms``: RMSNorms also on the attention and MLP outputs before their residual adds
    (``post_attention_layernorm`` / ``post_feedforward_layernorm``; the MLP's input norm is then
    ``pre_feedforward_layernorm``); ``embed_scale``: the embeddings are multiplied by it
    (``sqrt(hidden_size)``); ``attention_scale``: the softmax scale, ``None`` for ``head_dim ** -0.5``
    (``query_pre_attn_scalar ** -0.5``); ``attn_softcap`` / ``final_softcap``: attention scores and
    final logits become ``cap * tanh(x / cap)``, ``None`` for none; ``full_attention_layers``: the
    layers that ignore ``sliding_window`` (empty: the window, if any, is every layer's);
    ``local_rope_theta``: the RoPE base of the windowed layers, which take no ``rope_scaling``
    (Gemma 3's ``rope_local_base_freq``), ``None`` for every layer's RoPE alike.

    Mixture of experts (Qwen3-MoE, Mixtral; ``moe.py``): ``num_experts`` routed experts (0: every
    layer's MLP is dense), each token's ``experts_per_token`` highest router probabilities (softmax over
    all experts) choose its experts, renormalised to sum 1 with ``norm_topk_prob``; each expert is a
    SwiGLU MLP of ``moe_intermediate_size``; ``dense_mlp_layers`` keep the dense MLP of
    ``intermediate_size`` (Qwen3-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``).
    DeepSeek's router: ``router_scoring`` ``softmax`` or ``sigmoid`` (with a per-expert
    ``e_score_correction_bias`` added for the choice only); with ``expert_groups`` > 1 the experts
    form that many groups and each token chooses within its ``expert_groups_kept`` best groups (a
    group's score: its best expert's with softmax, its best two experts' sum with sigmoid, as
    DeepSeek-V2's ``group_limited_greedy`` and V3's ``noaux_tc``); the chosen weights are multiplied by
    ``routed_scaling_factor``; ``shared_experts`` SwiGLU experts of ``moe_intermediate_size`` each,
    fused into one MLP, run on every token beside the routed ones.

    Multi-head latent attention (DeepSeek-V2/V3, ``mla.py``) where ``kv_lora_rank`` > 0: each token's
    keys and values come from one latent of ``kv_lora_rank`` values (``kv_a_proj_with_mqa``, then
    ``kv_a_layernorm``) and one rotated key of ``head_dim`` values shared by all heads
    (``qk_rope_head_dim``); each head's query is ``qk_nope_head_dim`` + ``head_dim`` values (through a
    ``q_lora_rank`` bottleneck where that is set), its value ``v_head_dim``; ``rope_interleaved``: the
    rotated values pair up as (0, 1), (2, 3), ... (DeepSeek's layout) rather than rotate-half's halves.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    qk_norm: bool = False
    sliding_window: int | None = None
    rotary_dim: int | None = None
    pooling: str = "last"
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attention_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_mlp_layers: tuple[int, ...] = ()
    router_scoring: str = "softmax"
    expert_groups: int = 1
    expert_groups_kept: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} is not a positive number of tokens")
        if any(cap is not None and cap <= 0 for cap in (self.attn_softcap, self.final_softcap)):
            raise ValueError(f"soft-capping values must be positive, got {self.attn_softcap}, {self.final_softcap}")
        if not all(0 <= i < self.num_layers for i in self.full_attention_layers):
            raise ValueError(f"full_attention_layers={self.full_attention_layers} names a layer outside 0..{self.num_layers - 1}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} is not within 1..num_experts={self.num_experts}")
        if self.num_experts and (self.num_experts % self.expert_groups or not 0 < self.expert_groups_kept <= self.expert_groups):
            raise ValueError(f"expert_groups={self.expert_groups} (keeping {self.expert_groups_kept}) does not divide num_experts={self.num_experts}")
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router_scoring={self.router_scoring!r} is not softmax or sigmoid")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is a mixture of experts (else dense)."""
        dense = set(self.dense_mlp_layers)
        return tuple(bool(self.num_experts) and i not in dense for i in range(self.num_layers))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window in tokens, ``None`` for full causal attention."""
        full = set(self.full_attention_layers)
        return tuple(None if i in full else self.sliding_window for i in range(self.num_layers))

    @property
    def kv_window(self) -> int | None:
        """The window in tokens of a model whose every layer is windowed, ``None`` when some layer
        attends to every token: KV more than that far behind each query is read by no layer."""
        return None if self.full_attention_layers else self.sliding_window

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale: ``attention_scale``, else ``head_dim ** -0.5``."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim**-0.5

    @property
    def q_size(self) -> int:
        """Width of the query projection output (``num_heads * head_dim``; with latent attention
        ``num_heads * (qk_nope_head_dim + head_dim)``)."""
        return self.num_heads * (self.qk_nope_head_dim + self.head_dim)

    @property
    def kv_entry_size(self) -> int:
        """Values the KV pool holds per token and layer: a latent attention's latent and rotated key
        (``kv_lora_rank + head_dim``, shared by all heads), else every KV head's key and value."""
        return self.kv_lora_rank + self.head_dim if self.kv_lora_rank else 2 * self.kv_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection output (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim


def config_from_gguf(fields: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], path: Path) -> ModelConfig:
    """Build a ``ModelConfig`` from GGUF scalar metadata (key -> value) and the tensor shapes.

    ``tensor_shapes`` maps GGUF tensor names to row-major shapes (``token_embd.weight`` is
    ``(vocab, hidden)``). Keys follow the GGUF spec (``{arch}.block_count``, ...); ``vocab_size``
    falls back to the embedding's row count; ``head_dim`` is ``{arch}.attention.key_length``, else
    ``{arch}.rope.dimension_count``, else hidden / heads; rope scaling comes from
    ``{arch}.rope.scaling.*``; q/k/v biases and q/k norms are there when layer 0's tensors are;
    ``{arch}.attention.sliding_window`` (``GGUFWriter.add_sliding_window``) sets the window where present
    (0: none). A family with ``gguf_partial_rotary`` (Phi-3) reads ``rope.dimension_count`` as its
    ``rotary_dim`` and LongRoPE from its ``rope_factors_*`` tensors (``_gguf_rope_scaling``).
    Sandwich norms are there when layer 0's ``attn_post_norm`` is; experts where ``{arch}.expert_count``
    is (``expert_used_count``, ``expert_feed_forward_length``, ``expert_weights_norm``: llama.cpp's
    keys), routed in the layers that have a ``ffn_gate_inp`` router, dense in the others; the family's ``gguf_fields``
    add what llama.cpp derives from the architecture (Gemma's window pattern, scales, soft-capping).
    Raises ``ModelLoadError`` naming ``path`` for an unsupported architecture or a missing key.
    """
    arch = fields.get("general.architecture")
    family = family_for_gguf(arch)
    if family is None:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(gguf_architectures())})")

    def need(key: str) -> Any:
        try:
            return fields[f"{arch}.{key}"]
        except KeyError:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key!r} is missing") from None

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    key_length, rope_dims = fields.get(f"{arch}.attention.key_length"), fields.get(f"{arch}.rope.dimension_count")
    head_dim = int(key_length or (None if family.gguf_partial_rotary else rope_dims) or hidden // num_heads)
    rotary_dim = int(rope_dims) if family.gguf_partial_rotary and rope_dims and rope_dims != head_dim else None
    if "token_embd.weight" not in tensor_shapes:
        raise ModelLoadError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab = fields.get(f"{arch}.vocab_size") or tensor_shapes["token_embd.weight"][0]
    eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields]
    common = dict(
        architecture=family.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        sliding_window=int(fields.get(f"{arch}.attention.sliding_window") or 0) or None,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        rope_scaling=_gguf_rope_scaling(fields, arch, "rope_factors_long.weight" in tensor_shapes, path),
        rotary_dim=rotary_dim,
        pooling=GGUF_POOLING.get(int(fields.get(f"{arch}.pooling_type", 0)), "last"),
        sandwich_norms="blk.0.attn_post_norm.weight" in tensor_shapes,
    )
    experts = int(fields.get(f"{arch}.expert_count") or 0)
    if experts:  # llama.cpp's keys; a layer routes where it has ffn_gate_inp (the router), else it is dense
        common |= dict(
            num_experts=experts, experts_per_token=int(need("expert_used_count")),
            moe_intermediate_size=int(fields.get(f"{arch}.expert_feed_forward_length") or common["intermediate_size"]),
            norm_topk_prob=bool(fields.get(f"{arch}.expert_weights_norm", True)),  # llama.cpp's qwen3moe and llama renormalise
            dense_mlp_layers=tuple(i for i in range(common["num_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes),
        )
    try:
        return ModelConfig(**(common | family.gguf_fields(fields, arch, common)))
    except Unsupported as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def _gguf_rope_scaling(fields: Mapping[str, Any], arch: str, longrope: bool, path: Path) -> dict[str, Any] | None:
    """Translate ``{arch}.rope.scaling.*`` keys into an HF-style ``rope_parameters`` dict.

    ``longrope``: the file has llama.cpp's ``rope_factors_long``/``rope_factors_short`` tensors
    (``Phi3MiniModel.generate_extra_tensors`` in ``convert_hf_to_gguf.py``, no scaling type written):
    LongRoPE with ``{arch}.rope.scaling.original_context_length`` and ``.attn_factor``; the factors
    themselves are tensors, added when the weights load (``weights.py``).
    """
    if longrope:
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(fields[f"{arch}.rope.scaling.original_context_length"])}
        if f"{arch}.rope.scaling.attn_factor" in fields:
            scaling["attention_factor"] = float(fields[f"{arch}.rope.scaling.attn_factor"])
        return scaling
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"{path}: unsupported GGUF rope scaling type {kind!r}")
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(fields[f"{arch}.rope.scaling.original_context_length"])
    return scaling


def _check_longrope(rope: dict[str, Any], raw: Mapping[str, Any], rotary_dim: int, path: Path) -> None:
    """Complete ``rope`` (a ``longrope`` ``rope_parameters``) with ``original_max_position_embeddings``
    (transformers 5 keeps it there, older configs at the top level) and check its factors' lengths."""
    rope.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not rope["original_max_position_embeddings"]:
        raise ModelLoadError(f"{path}: rope_type 'longrope' needs original_max_position_embeddings")
    for key in ("short_factor", "long_factor"):
        if len(rope.get(key) or ()) != rotary_dim // 2:
            raise ModelLoadError(f"{path}: rope_parameters {key!r} must hold {rotary_dim // 2} values (rotary dimension / 2)")


def config_from_hf(raw: Mapping[str, Any], eos_extra: list[int], path: Path) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed Hugging Face ``config.json``.

    ``eos_extra`` adds end-of-sequence ids from ``generation_config.json``. Reads both the
    transformers 5 ``rope_parameters`` key and the older ``rope_theta`` / ``rope_scaling`` keys;
    the family's own fields come from its ``Family.hf_fields`` (after its ``hf_config``). Raises
    ``ModelLoadError`` naming ``path`` for an unsupported architecture, activation, rope type, layer
    type, Qwen2's sliding window, bidirectional attention or MLP biases.
    """
    arch = raw.get("model_type")
    family = family_for_hf(arch)
    if family is None:
        raise ModelLoadError(f"{path}: unsupported model_type {arch!r} (supported: {', '.join(hf_model_types())})")
    try:
        raw = family.hf_config(raw)
        own = {"attention_bias": False, **family.hf_fields(raw)}  # the family's own fields (attention_bias has no dataclass default)
    except Unsupported as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    except KeyError as exc:
        raise ModelLoadError(f"{path}: config.json lacks required key {exc.args[0]!r}") from None
    act_key = "hidden_activation" if "hidden_act" in own and "hidden_activation" in raw else "hidden_act"
    own["hidden_act"] = own.get("hidden_act", raw.get("hidden_act", "silu"))
    if own["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{path}: unsupported {act_key} {own['hidden_act']!r} (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
    # Qwen2's window over layers from max_window_layers on; biased MLPs; Gemma 3's embedding variant (not causal)
    for field in ("use_sliding_window", "mlp_bias", "use_bidirectional_attention"):
        if raw.get(field):
            raise ModelLoadError(f"{path}: unsupported {field} {raw[field]!r} (supported: false)")
    try:
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.setdefault("rope_type", rope.pop("type", "default"))
        if rope_type == "su":  # LongRoPE's first name in Phi-3 configs (transformers' Phi3Config renames it too)
            rope_type = rope["rope_type"] = "longrope"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"{path}: unsupported rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        num_heads = int(raw["num_attention_heads"])
        head_dim = int(raw.get("head_dim") or raw["hidden_size"] // num_heads)
        rotary_dim = int(head_dim * float(rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))))
        if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
            raise ModelLoadError(f"{path}: unsupported partial_rotary_factor: {rotary_dim} rotary values of a {head_dim}-value head (supported: even splits)")
        if rope_type == "longrope":
            _check_longrope(rope, raw, rotary_dim, path)
        layer_types = own.pop("layer_types", None)
        if layer_types is not None:
            own["full_attention_layers"] = _full_attention_layers(layer_types, int(raw["num_hidden_layers"]), path)
        eos = raw.get("eos_token_id")
        eos_ids = ([] if eos is None else [eos] if isinstance(eos, int) else list(eos)) + eos_extra
        return ModelConfig(
            architecture=family.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids)),
            rope_scaling=None if rope_type == "default" else rope,
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            pooling=pooling_of_hf(path.parent),
            **own,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: config.json lacks required key {exc.args[0]!r}") from None


def _full_attention_layers(layer_types: object, num_layers: int, path: Path) -> tuple[int, ...]:
    """The indices of ``layer_types``' ``full_attention`` layers. Raises ``ModelLoadError`` naming
    ``path`` for a list of another length or another value (``LAYER_TYPES``)."""
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: layer_types must list one of {', '.join(LAYER_TYPES)} for each of the {num_layers} layers")
    for kind in layer_types:
        if kind not in LAYER_TYPES:
            raise ModelLoadError(f"{path}: unsupported layer_types value {kind!r} (supported: {', '.join(LAYER_TYPES)})")
    return tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
