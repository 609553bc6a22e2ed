"""The limits a `stageserve.prepare.scheduler.Scheduler` plans within: the device's (from its ``AttachReply``) and prepare's own."""

from __future__ import annotations

from dataclasses import dataclass

from stageserve.prepare.draft_planner import StepCostModel
from stageserve.v1 import device_pb2


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler plans within.

    Attributes:
        max_num_seqs: seq indices ``[0, max_num_seqs)`` (the device's sequence table).
        max_step_tokens: tokens one step may carry (prefill chunks + decode rows).
        kv_num_blocks, kv_block_size: the device's KV pool (blocks; tokens per block).
        max_prefill_chunk: prompt tokens of one sequence per step at most.
        max_waiting: requests the waiting queue holds at most.
        enable_prefix_caching: share published full prompt blocks between requests.
        model_identity: what else changes a block's KV (the model); part of every block hash.
        num_speculative_tokens: drafts a decode row may ask the device for (0: it does not speculate).
        speculative_method: the device's proposer (``ngram``: prompt lookup, which prepare replays).
        step_costs: the device's measured decode-step costs, by which drafts are planned
            (`draft_planner`); ``None``: every decode row asks for ``num_speculative_tokens``.
        kv_window: the device's ``kv_window`` (tokens): every layer attends at most this far back,
            so the blocks a sequence's window has left behind are released; 0: none are.
        pipeline_depth: steps unpublished at most, the one being scheduled included (the device's
            output slots; the engine's credits keep to it). It bounds the rows of one sequence in
            flight, hence what a windowed sequence holds and reserves (see the scheduler).
    """

    max_num_seqs: int
    max_step_tokens: int
    kv_num_blocks: int
    kv_block_size: int
    max_prefill_chunk: int
    max_waiting: int
    enable_prefix_caching: bool = True
    model_identity: str = ""
    num_speculative_tokens: int = 0
    speculative_method: str = ""
    step_costs: StepCostModel | None = None
    kv_window: int = 0
    pipeline_depth: int = 2

    @classmethod
    def from_attach(cls, reply: device_pb2.AttachReply, max_prefill_chunk: int, max_waiting: int,
                    enable_prefix_caching: bool = True) -> "SchedulerConfig":
        """The device's limits and model from its ``AttachReply`` plus prepare's own flags."""
        return cls(
            max_num_seqs=reply.max_num_seqs,
            max_step_tokens=reply.max_step_tokens,
            kv_num_blocks=reply.kv_num_blocks,
            kv_block_size=reply.kv_block_size,
            max_prefill_chunk=max_prefill_chunk,
            max_waiting=max_waiting,
            enable_prefix_caching=enable_prefix_caching,
            model_identity=f"{reply.model_name}|{reply.dtype}",
            num_speculative_tokens=reply.num_speculative_tokens,
            speculative_method=reply.speculative_method,
            step_costs=StepCostModel.from_attach(reply),
            kv_window=reply.kv_window,
            pipeline_depth=max(1, reply.pipeline_depth),
        )
