"""A decode-only step's layers in one C++ call (`model.fused_decode`): the same bits as the model's
fused Python path, logits and KV cache alike, for the layers it takes (mixtures of experts included);
the Python path for the rest."""

from __future__ import annotations

import pytest
import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.fused_decode import FusedDecodeLayers
from stageserve.model_files import embedded_model_path
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import decode_run

pytestmark = pytest.mark.skipif(not (cpu_kernels.load_cpu_kernels() and cpu_kernels.has_avx512_vnni()),
                                reason="decode_layers runs the linears on quant_linear: AVX512-VNNI and the CPU kernels")

BLOCK = 16


def assert_same_bits_as_python_path(model: DecoderModel, prompts: list[list[int]], steps: int = 6) -> None:
    fused = model.fused_decode
    assert fused is not None and fused.takes(build_forward_batch([([1], 3, [r], True) for r in range(len(prompts))], BLOCK, "cpu"))
    ours = decode_run(model, prompts, steps)
    model.fused_decode = None
    try:
        python = decode_run(model, prompts, steps)
    finally:
        model.fused_decode = fused
    assert torch.equal(ours[0], python[0]) and torch.equal(ours[1], python[1])


@pytest.mark.parametrize("rows", [1, 3, 12])
def test_the_embedded_q4_1_model_gives_the_python_paths_bits(rows):
    """12 rows: past the kernel's 8-row pass, taken because no linear keeps a dense copy."""
    model = DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu", weight_format="auto", dense_copy="none")
    prompts = [[(7 * i + 3 * r) % 1000 + 10 for i in range(20 + 9 * r)] for r in range(rows)]
    assert_same_bits_as_python_path(model, prompts)


@pytest.mark.parametrize("family, overrides", [
    ("qwen3", {}),  # q/k head norms
    ("qwen3", {"attention_bias": True}),  # a bias on qkv and on o
    ("mistral", {}),  # a sliding window shorter than the prompts
])
def test_int8_families_give_the_python_paths_bits(tmp_path, family, overrides):
    path = write_tiny_checkpoint(tmp_path, family=family, sliding_window=8 if family == "mistral" else None, overrides=overrides)
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="int8")
    if overrides.get("attention_bias"):
        assert model.layers[0].qkv.bias is not None and model.layers[0].o.bias is not None
    assert_same_bits_as_python_path(model, [[(5 * i + r) % 250 + 1 for i in range(21 + 4 * r)] for r in range(2)], steps=12)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("rows", [1, 5])
def test_mixtures_of_experts_give_the_python_paths_bits(tmp_path, family, rows):
    """Qwen3-MoE (a dense first layer, the top 2 of 8 renormalised) and Mixtral (experts in every layer):
    one row runs its experts in turn, more are grouped by expert, on either path alike."""
    path = write_tiny_checkpoint(tmp_path, family=family)
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="int8")
    assert sum(layer.moe is not None for layer in model.layers) == (1 if family == "qwen3_moe" else 2)
    assert_same_bits_as_python_path(model, [[(3 * i + 7 * r) % 250 + 1 for i in range(17 + 5 * r)] for r in range(rows)], steps=8)


def test_a_mixture_whose_experts_differ_in_format_runs_the_python_path(tmp_path):
    """decode_layers runs a step's chosen experts in one call for their gate_ups and one for their
    downs, which takes one format: a layer whose experts' kernels differ (here one down on the other
    input level) is not flattened."""
    model = DecoderModel.from_path(write_tiny_checkpoint(tmp_path, family="mixtral"), torch.float32, "cpu", weight_format="int8")
    assert FusedDecodeLayers.for_model(model) is not None
    kernel = model.layers[1].moe.downs[3].kernel
    kernel.input_bits = 8 if kernel.input_bits == 16 else 16
    assert FusedDecodeLayers.for_model(model) is None


def test_a_routers_logits_do_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    x = torch.randn(9, 200, dtype=torch.bfloat16)
    weight = torch.randn(24, 200)
    together = cpu_kernels.router_logits(x, weight)
    assert together.dtype == torch.float32 and together.shape == (9, 24)
    assert all(torch.equal(cpu_kernels.router_logits(x[r : r + 1].contiguous(), weight)[0], together[r]) for r in range(9))
    torch.testing.assert_close(together, x.float() @ weight.T, rtol=1e-5, atol=1e-4)


def test_what_it_does_not_take_runs_the_python_path(tmp_path):
    """A step with a prefill row, or more rows than a linear's kernel takes where it keeps a dense copy
    for them, goes through the Python path; DeepSeek's latent attention and grouped routing or a dense
    model is not flattened at all."""
    model = DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu", weight_format="auto", dense_copy="all")
    decode = build_forward_batch([([4], 3, [1], True)], BLOCK, "cpu")
    mixed = build_forward_batch([([4], 3, [1], True), ([1, 2, 3], 0, [2], True)], BLOCK, "cpu")
    many = build_forward_batch([([4], 3, [r], True) for r in range(model.layers[0].qkv.kernel.max_rows + 1)], BLOCK, "cpu")
    assert model.fused_decode.takes(decode) and not model.fused_decode.takes(mixed) and not model.fused_decode.takes(many)
    without_copies = DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu", weight_format="auto", dense_copy="none")
    assert without_copies.fused_decode.takes(many) and not without_copies.fused_decode.takes(mixed)
    assert DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu").fused_decode is None  # dense bfloat16 linears
    deepseek = write_tiny_checkpoint(tmp_path, family="deepseek_v3")
    assert DecoderModel.from_path(deepseek, torch.float32, "cpu", weight_format="int8").fused_decode is None


def test_lists_that_do_not_fit_are_refused():
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="per-layer lists of different lengths"):
        cpu_kernels.decode_layers(x, [], [torch.ones(64)], [], [], [], [0, 0, 0], [], torch.zeros(1, 2, 1, 16, 64), [], [], [0], [0],
                                  torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64),
                                  1, 1, 1.0, 0.0, 1e-6)
