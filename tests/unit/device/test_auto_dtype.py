"""``--dtype auto``: bfloat16 wherever the step runs bfloat16 well, float32 only for dense weights on a
CPU without native bfloat16 matmuls (`flags.resolve_dtype`, `assembly._linears_on_vnni_kernel`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from stageserve.device.assembly import _linears_on_vnni_kernel
from stageserve.device.flags import add_arguments, resolve_dtype
from stageserve.device.kernels import cpu_kernels
from stageserve.model_files import embedded_model_path


def device_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def native_bf16() -> bool:
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "").split()
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def test_an_explicit_dtype_is_kept_and_accelerators_take_bfloat16():
    assert resolve_dtype("float32", "cpu", quantized_kernels=True) == "float32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "npu") == "bfloat16"


def test_auto_on_the_cpu_is_bfloat16_for_the_vnni_kernel_and_native_bf16_else_float32():
    assert resolve_dtype("auto", "cpu", quantized_kernels=True) == "bfloat16"
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native_bf16() else "float32")


@pytest.mark.parametrize("argv, quantized", [
    ([], True),                                # the embedded Q4_1 file: its linears stay quantized
    (["--weights", "int8"], True),
    (["--weights", "dequantize"], False),
    (["--no-cpu-kernels"], False),             # torch's int4/int8 kernels, not the VNNI one
    (["--backend", "cuda"], False),
])
def test_the_vnni_kernel_runs_the_linears_of_a_quantized_gguf_on_the_cpu(argv, quantized):
    expected = quantized and cpu_kernels.has_avx512_vnni()
    assert _linears_on_vnni_kernel(device_args(argv), embedded_model_path()) == expected


def test_an_hf_directorys_dense_linears_are_not_on_the_vnni_kernel(tmp_path):
    assert not _linears_on_vnni_kernel(device_args([]), tmp_path)
