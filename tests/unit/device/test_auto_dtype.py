"""``--dtype auto``: bfloat16 wherever the step runs bfloat16 well, float32 only for dense weights on a
CPU without native bfloat16 matmuls (`flags.resolve_dtype`, `assembly.device_dtype`)."""

from __future__ import annotations

import argparse

import pytest
import torch

from stageserve.device.assembly import _linears_on_vnni_kernel, _load_decoder, device_dtype
from stageserve.device.flags import add_arguments, resolve_dtype
from stageserve.device.kernels.quant_linear import vnni_kernel_runs
from stageserve.model_files import embedded_model_path
from tests.unit.device.test_cpu_kernels import CPU_FLAGS


def device_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


NATIVE_BF16 = bool({"avx512_bf16", "amx_bf16"} & CPU_FLAGS)


def test_an_explicit_dtype_is_kept_and_accelerators_take_bfloat16():
    assert resolve_dtype("float32", "cpu", quantized_kernels=True) == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "npu") == "bfloat16"


def test_auto_on_the_cpu_is_bfloat16_for_the_vnni_kernel_and_native_bf16_else_float32():
    assert resolve_dtype("auto", "cpu", quantized_kernels=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if NATIVE_BF16 else "float32")


@pytest.mark.parametrize("argv, quantized", [
    ([], True),                                # the embedded Q4_1 file: its linears stay quantized
    (["--weights", "int8"], True),
    (["--weights", "dequantize"], False),
    (["--no-cpu-kernels"], False),             # torch's int4/int8 kernels, not the VNNI one
    (["--backend", "sim"], True),              # sized as the cpu backend
])
def test_the_device_runs_a_quantized_gguf_in_bfloat16_where_the_vnni_kernel_takes_its_linears(argv, quantized):
    args = device_args(argv)
    # what auto weighs, asserted apart: on a CPU with native bfloat16 the dtype is bfloat16 either way
    assert _linears_on_vnni_kernel(args, embedded_model_path()) == (quantized and vnni_kernel_runs())
    expected = "bfloat16" if (quantized and vnni_kernel_runs()) or NATIVE_BF16 else "float32"
    assert device_dtype(args, embedded_model_path()) == expected


def test_the_device_keeps_an_explicit_dtype_and_gives_an_accelerator_bfloat16():
    assert device_dtype(device_args(["--backend", "cuda"]), embedded_model_path()) == "bfloat16"
    assert device_dtype(device_args(["--dtype", "float32"]), embedded_model_path()) == "float32"


def test_an_hf_directorys_dense_linears_stay_float32_without_native_bf16(tmp_path):
    assert device_dtype(device_args([]), tmp_path) == ("bfloat16" if NATIVE_BF16 else "float32")


def test_float32_without_the_cpu_kernels_keeps_a_quantized_gguf_dense():
    """torch's int4/int8 kernels are slow with float32 input: with ``--no-cpu-kernels`` the VNNI
    kernel does not run, so ``--weights auto`` dequantizes (it kept int4 on torch's kernels before)."""
    model = _load_decoder(device_args(["--no-cpu-kernels"]), embedded_model_path(), torch.float32, "cpu")
    assert dict(model.linear_formats) == {"float32": 121}
