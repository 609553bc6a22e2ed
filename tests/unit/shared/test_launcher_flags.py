"""``stageserve up``'s device flags: what it passes on is what the device parses back."""

from __future__ import annotations

import argparse

import pytest

from stageserve.device.flags import add_arguments as add_device_arguments
from stageserve.launcher import _service_args
from stageserve.launcher import add_arguments as add_up_arguments


def up(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser.parse_args(argv)


def device(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_device_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, expected", [
    ([], {"weights": "auto", "dense_copy": "auto", "kv_cache_memory": None}),
    (["--weights", "dequantize", "--no-dense-copy", "--kv-cache-memory", "256MiB"],
     {"weights": "dequantize", "dense_copy": "none", "kv_cache_memory": 256 * 2**20}),
    (["--dense-copy", "all"], {"dense_copy": "all"}),
])
def test_the_devices_memory_and_weight_flags_reach_it(argv, expected):
    parsed = device(_service_args(up(argv))[0])
    assert {name: getattr(parsed, name) for name in expected} == expected
