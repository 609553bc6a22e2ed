"""Weights moved into one memory map advised for transparent huge pages (`huge_pages`, `quant_linear.move_onto_huge_pages`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from stageserve.device.kernels import cpu_kernels, quant
from stageserve.device.kernels.huge_pages import HUGE_PAGE, onto_huge_pages
from stageserve.device.kernels.quant_linear import QuantizedLinear, VnniKernel, move_onto_huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str]:
    """The fields of the ``/proc/self/smaps`` entry whose range holds ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            entry = {} if start <= address < end else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_keep_values_dtypes_and_shapes_one_after_another_on_cache_lines():
    tensors = [torch.randn(1000, 700), torch.arange(7, dtype=torch.int16), torch.randint(0, 256, (3_000_000,), dtype=torch.uint8),
               torch.empty(0, 5), torch.randn(3, 5).to(torch.bfloat16)]
    copies = onto_huge_pages(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
    held = [c for c in copies if c.numel()]  # an empty tensor has no address
    assert all(c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr() for c, t in zip(held, tensors))
    assert len({c.untyped_storage().data_ptr() for c in held}) == 1  # one region
    assert [c.data_ptr() for c in held] == sorted(c.data_ptr() for c in held)  # in the order given
    assert copies[0].untyped_storage().nbytes() == sum(-(-t.nbytes // 64) * 64 for t in tensors)  # what is held, not the map's tail


def test_less_than_one_huge_page_in_all_stays_where_it_is():
    tensors = [torch.randn(100, 100), torch.ones(3)]
    assert all(c is t for c, t in zip(onto_huge_pages(tensors), tensors))
    assert onto_huge_pages([]) == []


def test_a_tensor_elsewhere_than_the_cpu_is_refused():
    with pytest.raises(ValueError, match="CPU tensors only"):
        onto_huge_pages([torch.empty(HUGE_PAGE, device="meta")])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="transparent huge pages: Linux with them not set to never")
def test_the_region_is_private_anonymous_memory_on_a_huge_page_boundary_that_may_take_huge_pages():
    copy = onto_huge_pages([torch.ones(HUGE_PAGE + 1, dtype=torch.uint8)])[0]
    mapping = _mapping_of(copy.data_ptr())
    assert mapping["THPeligible"] == "1"  # advised (or THP always) and anonymous: shared memory would say 0
    assert "hg" in mapping["VmFlags"].split() or "[always]" in THP_SETTING.read_text()  # MADV_HUGEPAGE
    assert copy.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not cpu_kernels.has_avx512_vnni(), reason="the VNNI kernel needs AVX512-VNNI")
def test_moved_linears_give_the_same_bits_from_one_region():
    weights = [quant.kernel_weight([torch.randn(rows, 576) * 0.05], "int4") for rows in (4096, 2048, 576)]  # 2.5 MiB: more than a huge page
    linears = [QuantizedLinear(w, None, torch.bfloat16) for w in weights] + [torch.nn.Identity()]  # not quantized: skipped
    x = torch.randn(3, 576).to(torch.bfloat16)
    before = [lin(x) for lin in linears[:3]]
    held = sum(t.nbytes for lin in linears[:3] for t in lin.kernel.tensors())
    assert move_onto_huge_pages(linears) == held
    assert all(isinstance(lin.kernel, VnniKernel) for lin in linears[:3])
    assert len({t.untyped_storage().data_ptr() for lin in linears[:3] for t in lin.kernel.tensors()}) == 1
    for lin, expected in zip(linears[:3], before):
        assert torch.equal(lin(x), expected)
