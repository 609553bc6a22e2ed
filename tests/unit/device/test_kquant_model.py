"""A tiny llama GGUF with K-quant (Q4_K/Q5_K/Q6_K) and Q5_0 tensors served as stored (``--weights auto``)
against the same file dequantized: float32 activations, so the two runs differ only by the VNNI
kernel's two-level input rounding (``quant_linear``; at most a 65278th of each input group's largest
value), and by nothing else; a decode row's tokens and logits alone equal those it gets in a batch.
"""

from __future__ import annotations

import logging

import gguf
import pytest
import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.model.decoder import DecoderModel
from tests.unit.device.test_model_reference import decode_run, greedy
from tests.unit.device.test_weights import write_gguf

Q = gguf.GGMLQuantizationType
HIDDEN, FFN = 256, 512  # multiples of the K-quants' super-block of 256
FILES = {  # as llama.cpp's Q4_K_M and Q6_K mixes: K-quants where K is a multiple of 256, Q5_0 / Q8_0 where not (o: K = 64)
    "q4_k_m": {"blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,
               "blk.0.attn_output.weight": Q.Q5_0, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q5_K,
               "blk.0.ffn_down.weight": Q.Q6_K},
    "q6_k": {"blk.0.attn_q.weight": Q.Q6_K, "blk.0.attn_k.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K,
             "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q6_K, "blk.0.ffn_up.weight": Q.Q6_K,
             "blk.0.ffn_down.weight": Q.Q6_K},
}
FORMATS = {"q4_k_m": {"q4_k+q6_k": 1, "int5": 1, "q5_k": 1, "q6_k": 1, "int8": 1}, "q6_k": {"q6_k": 3, "int8": 2}}
PROMPTS = [[1, 5, 9, 33, 70], [3, 3, 3], [90, 12, 44, 8, 61, 17, 2], [40]]
NEW_TOKENS = 32

needs_vnni = pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="the VNNI kernel needs AVX512-VNNI")


@pytest.fixture(scope="module", params=list(FILES))
def models(request, tmp_path_factory) -> dict[str, DecoderModel]:
    path = tmp_path_factory.mktemp("kquant") / f"{request.param}.gguf"
    write_gguf(path, FILES[request.param], ffn=FFN, hidden=HIDDEN)
    built = {fmt: DecoderModel.from_path(path, torch.float32, "cpu", weight_format=fmt, dense_copy="none") for fmt in ("dequantize", "auto")}
    assert built["auto"].linear_formats == FORMATS[request.param]
    return built


@needs_vnni
def test_the_weights_hold_about_the_files_bytes(models):
    """The start-up line's figure (`weight_bytes`) against the float32 model: at most 0.3x (6.5625 / 32 bits for Q6_K, plus the norms)."""
    quantized, dense = models["auto"], models["dequantize"]
    assert quantized.weight_bytes() <= 0.3 * quantized.dense_weight_bytes(torch.float32)
    assert quantized.weight_bytes() < dense.weight_bytes()


@needs_vnni
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_the_dequantized_runs(models, prompt):
    (tokens, logits), (ref_tokens, ref_logits) = (greedy(models[fmt], prompt, NEW_TOKENS) for fmt in ("auto", "dequantize"))
    assert tokens == ref_tokens
    # measured: at most 1.3e-3 of the step's largest logit (1.2e-4 to 1.8e-4 for the other prompts)
    assert ((logits - ref_logits).abs() <= 5e-3 * ref_logits.abs().amax(-1, keepdim=True)).all()


@needs_vnni
def test_a_decode_row_gives_the_same_logits_alone_and_in_a_batch(models):
    """Four sequences decoded together, one step of four rows each time, against each decoded alone."""
    together = decode_run(models["auto"], PROMPTS, 8)[0]
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(decode_run(models["auto"], [prompt], 8)[0][:, 0], together[:, i]), i


def test_without_vnni_the_formats_without_a_kernel_are_dequantized_with_a_log_line(tmp_path, monkeypatch, caplog):
    """As on a CPU without AVX512-VNNI: the Q8_0 head on torch's int8 kernel; int5, Q5_K (the fused gate/up:
    Q4_K in Q5_K) and Q6_K (with Q4_K beside it: q/k/v) dense, named in one log line."""
    monkeypatch.setattr(cpu_kernels, "has_avx512_vnni", lambda: False)
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(path, FILES["q4_k_m"], ffn=FFN, hidden=HIDDEN)
    with caplog.at_level(logging.INFO, logger="stageserve.device.model.decoder"):
        model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="auto", dense_copy="none")
    assert model.linear_formats == {"float32": 4, "int8": 1}
    assert "linears of format int5, q4_k+q6_k, q5_k, q6_k dequantized to float32" in caplog.text
    dense = DecoderModel.from_path(path, torch.float32, "cpu")
    assert greedy(model, PROMPTS[0], 8)[0] == greedy(dense, PROMPTS[0], 8)[0]
