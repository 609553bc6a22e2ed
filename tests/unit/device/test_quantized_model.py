"""The embedded Q4_1 model served as it is stored (``--weights auto``: int4 layers, int8 tied head)
against its dequantized bfloat16 run.

Bound at a greedy divergence (documented in docs/backends.md): the two runs differ only by where
they round (the quantized path's int8 activations, one level where no dense copy is kept, or torch's
kernels' bf16 group scales and per-row int8 head, against bf16 weights), so where their greedy tokens part,
both tokens are a near tie in both runs: within ``TIE_LOGITS`` of each other; and no logit of any step up to
there differs by more than ``MAX_LOGIT_DIFF`` (seen: 0.94–1.94 on the VNNI kernel on one input level,
0.53–1.53 on two, 0.72–1.13 on torch's).
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.kernels.quant_linear import vnni_kernels
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from stageserve.model_files import embedded_model_path
from stageserve.tokenizer import load_tokenizer
from tests.unit.device.test_model_reference import PROMPT, decode_run, greedy

TIE_LOGITS = 1.0
MAX_LOGIT_DIFF = 2.5
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,", "Water boils at"]
PASSAGE = (
    "The river rises in the hills to the north of the town and runs south through farmland for about forty miles "
    "before it reaches the sea. In the spring, when the snow melts, it often floods the low fields near its banks, "
    "and the farmers have built long earth walls to hold the water back. The town grew up around a stone bridge that "
    "was built more than six hundred years ago, and the bridge is still used by cars and people every day. "
    "Visitors come in the summer to walk along the river, to fish, and to see the old mill, which has been turned into a museum."
)


@pytest.fixture(scope="module")
def models() -> dict[str, DecoderModel]:
    path = embedded_model_path()
    # auto without its dense copy: every linear's values come from the quantized weight (kernel or per-call dequantization)
    return {fmt: DecoderModel.from_path(path, torch.bfloat16, "cpu", weight_format=fmt, dense_copy="none") for fmt in ("dequantize", "auto")}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def test_auto_keeps_the_q4_layers_int4_and_the_q8_head_int8_in_under_half_the_memory(models):
    """Without dense copies (``--dense-copy none``)."""
    quantized, dense = models["auto"], models["dequantize"]
    assert quantized.linear_formats == {"int4": 120, "int8": 1}
    assert dense.linear_formats == {"bfloat16": 121}
    assert quantized.weight_bytes() <= 0.5 * quantized.dense_weight_bytes(torch.bfloat16)
    # The bfloat16 path holds oneDNN's packed copy, and an AMX copy beside it where the CPU has AMX.
    dense_copies_held = 2 if dense.amx_linears else 1
    assert quantized.weight_bytes() < 0.5 * dense.weight_bytes() / dense_copies_held


def test_auto_holds_at_most_one_dense_copy_of_the_model_where_its_copies_are_onednns():
    """The default (``--dense-copy auto``): the copies timed faster on this CPU, within the budget
    where they are oneDNN's; AMX-packed copies are kept wherever faster (at most every copy: 1.37x)."""
    model = DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu", weight_format="auto")
    assert model.linear_formats == {"int4": 120, "int8": 1}
    limit = 1.4 if model.amx_dense_copies else 1.0
    assert model.weight_bytes() <= limit * model.dense_weight_bytes(torch.bfloat16)


@pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="the VNNI kernel needs AVX512-VNNI")
def test_without_dense_copies_a_decode_row_gets_the_same_bits_alone_and_among_eleven_others(models):
    """Every row count on the VNNI kernel, on one input level (`quant_linear.input_bits_for`): a decode
    row's bfloat16 logits are bit for bit the same alone and in a step of 12 rows (past the kernel's
    8-row pass), so concurrency never changes a token."""
    model = models["auto"]
    assert {kernel.input_bits for kernel in vnni_kernels(model.linears_in_step_order())} == {8}
    prompts = [[(7 * i + 3 * r) % 900 + 20 for i in range(5 + 3 * r)] for r in range(12)]
    together = decode_run(model, prompts, 3)[0]
    for r in (0, 5, 11):
        assert torch.equal(decode_run(model, [prompts[r]], 3)[0][:, 0], together[:, r]), r


@pytest.mark.parametrize("index", range(len(PROMPTS) + 1))
def test_greedy_tokens_agree_with_bfloat16_or_part_at_a_near_tie(models, tokenizer, index):
    prompt = PROMPT if index == 0 else tokenizer.encode(PROMPTS[index - 1])
    (tokens_bf16, logits_bf16), (tokens_int4, logits_int4) = (greedy(models[fmt], prompt, 32) for fmt in ("dequantize", "auto"))
    part = next((i for i, (a, b) in enumerate(zip(tokens_bf16, tokens_int4)) if a != b), None)
    upto = 32 if part is None else part + 1
    assert (logits_bf16[:upto].float() - logits_int4[:upto].float()).abs().max() <= MAX_LOGIT_DIFF
    if part is not None:
        a, b = tokens_bf16[part], tokens_int4[part]
        for logits in (logits_bf16[part].float(), logits_int4[part].float()):
            assert abs(logits[a] - logits[b]) <= TIE_LOGITS, (part, a, b)


def _perplexity(model: DecoderModel, ids: list[int], chunk: int = 4) -> float:
    """exp(mean negative log-likelihood) of ``ids`` under ``model``, fed ``chunk`` tokens a step with
    every position's logits (chunks of 4 rows run the int4 kernel, as decode steps do)."""
    block_size = 16
    blocks = -(-len(ids) // block_size)
    cache = PagedKVCache(model.config, blocks + 1, block_size, model.dtype, "cpu")
    table = list(range(1, blocks + 1))
    nll = 0.0
    for start in range(0, len(ids) - 1, chunk):
        piece = ids[start : min(start + chunk, len(ids) - 1)]
        batch = build_forward_batch([(piece, start, table, True)], block_size, "cpu")
        batch.sample_indices = torch.arange(len(piece))
        logprobs = model.forward(batch, cache).float().log_softmax(-1)
        nll -= logprobs[torch.arange(len(piece)), torch.tensor(ids[start + 1 : start + 1 + len(piece)])].sum().item()
    return math.exp(nll / (len(ids) - 1))


def test_perplexity_on_a_fixed_passage_is_within_two_percent_of_bfloat16(models, tokenizer):
    ids = tokenizer.encode(PASSAGE)
    dense, quantized = (_perplexity(models[fmt], ids) for fmt in ("dequantize", "auto"))
    assert 1 < dense < 50  # the model reads English
    assert abs(quantized / dense - 1) <= 0.02, (quantized, dense)
