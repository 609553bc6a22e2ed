"""The device's start-up measurement of its decode-step costs, on a tiny checkpoint (a real model,
executor and sequence table; no services)."""

from __future__ import annotations

import argparse

from stageserve.device import assembly as device_assembly, flags as device_flags
from stageserve.device.speculation.step_costs import LONG_CONTEXT, ROW_POINTS, SHORT_CONTEXT

from tests.tiny_checkpoint import write_tiny_checkpoint


def core(tmp_path, *flags: str):
    parser = argparse.ArgumentParser()
    device_flags.add_arguments(parser)
    model = write_tiny_checkpoint(tmp_path / "tiny")
    args = parser.parse_args(["--model", str(model), "--dtype", "float32", "--speculative-method", "ngram", "--num-speculative-tokens", "2", *flags])
    return device_assembly.build_core(args, model)


def cells(built) -> set[tuple[int, int, int]]:
    return {(cost.rows, cost.drafts, cost.context_tokens) for cost in built.attach_reply.step_costs}


def test_every_row_count_and_draft_count_is_measured_and_a_long_context_line(tmp_path):
    built = core(tmp_path)
    expected = {(rows, k, SHORT_CONTEXT) for rows in ROW_POINTS for k in range(3)} | {(8, k, LONG_CONTEXT) for k in range(3)}
    assert cells(built) == expected
    assert all(cost.seconds > 0 for cost in built.attach_reply.step_costs)
    assert built.table.active_count() == 0  # the measured sequences are gone
    assert built.attach_reply.drops_unproposed_drafts  # a CPU device runs only the proposed drafts
    built.executor.close()


def test_a_small_pool_and_table_drop_the_largest_row_counts_first_and_always_skips_the_measurement(tmp_path):
    # 12 sequences: the long-context group's 8, then 1 + 2 short ones (4 would pass 12); a pool that holds them all.
    built = core(tmp_path, "--max-num-seqs", "12", "--kv-cache-memory", "64MiB")
    assert cells(built) == {(rows, k, SHORT_CONTEXT) for rows in (1, 2) for k in range(3)} | {(8, k, LONG_CONTEXT) for k in range(3)}
    built.executor.close()
    built = core(tmp_path, "--speculative-policy", "always")
    assert not built.attach_reply.step_costs
    built.executor.close()
