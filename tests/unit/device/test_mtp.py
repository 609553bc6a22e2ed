"""The MTP proposer on tiny DeepSeek-V3 checkpoints with a multi-token-prediction layer written in
the Hugging Face layout (`tests.tiny_checkpoint.add_mtp_layer`).

A module that reproduces its one-layer target exactly drafts the target's greedy continuation,
after the prefill and after a step that accepted every draft. As in test_draft_model.py the
target's verification is played by the test (tests/integration/test_speculative.py runs the whole
path through the three services).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stageserve.device.model.config import ModelLoadError
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.weights import load_mtp_weights
from stageserve.device.speculation.mtp import MTPModule, MTPProposer
from stageserve.device.speculation.proposer import ProposalStep, StepLayout, TokenHistory
from tests.unit.device.greedy_reference import BLOCK_SIZE, CPU, NUM_BLOCKS, TABLE, greedy_continuation
from tests.tiny_checkpoint import add_mtp_layer, write_tiny_checkpoint

K = 3
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111]


def test_the_mtp_layer_loads_as_a_one_layer_model_of_the_layer_after_the_last(tmp_path):
    """Layer 2 of a two-layer target (the first dense): a mixture of experts, its own tensors."""
    path = add_mtp_layer(write_tiny_checkpoint(tmp_path / "v3", family="deepseek_v3"))
    stored = load_file(path / "model-mtp.safetensors")
    config, weights = load_mtp_weights(path, torch.float32)
    assert config.num_layers == 1 and config.moe_layers == (True,) and config.kv_lora_rank == 32
    assert weights["mtp.eh_proj.weight"].shape == (64, 128)
    for ours, theirs in (("mtp.enorm.weight", "enorm.weight"), ("model.norm.weight", "shared_head.norm.weight"),
                         ("lm_head.weight", "shared_head.head.weight"), ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                                                         "self_attn.kv_a_proj_with_mqa.weight")):
        assert torch.equal(weights[ours], stored["model.layers.2." + theirs]), ours
    target = load_file(path / "model.safetensors")
    assert not torch.equal(weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"], target["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"])


def test_a_checkpoint_without_mtp_layers_is_refused_saying_what_to_use(tmp_path):
    """transformers writes ``num_nextn_predict_layers`` 1 and no such layer; with 0 the config says
    so; llama.cpp's GGUF drops the layer."""
    path = write_tiny_checkpoint(tmp_path / "v3", family="deepseek_v3")
    with pytest.raises(ModelLoadError, match=r"has none \(no model.layers.2.\* tensors, though config.json's num_nextn_predict_layers is 1\); "
                                             "choose --speculative-method ngram or draft"):
        load_mtp_weights(path, torch.float32)
    config = path / "config.json"
    config.write_text(config.read_text().replace('"num_nextn_predict_layers": 1', '"num_nextn_predict_layers": 0'))
    with pytest.raises(ModelLoadError, match="num_nextn_predict_layers is 0; choose --speculative-method ngram or draft"):
        load_mtp_weights(path, torch.float32)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="a GGUF file does not carry them here; choose --speculative-method ngram or draft"):
        load_mtp_weights(gguf, torch.float32)


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    """A one-layer DeepSeek-V3 (its layer a mixture of experts) and an MTP layer that copies it."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("v3"), family="deepseek_v3", num_layers=1, overrides={"first_k_dense_replace": 0})
    add_mtp_layer(path, copy_target=True)
    return DecoderModel.from_path(path, torch.float32, CPU), MTPModule.from_path(path, torch.float32, CPU)


def layout(tokens: int, decode_drafts: int | None, started: bool) -> StepLayout:
    """One row of ``tokens`` batch tokens of sequence 0 that samples: a prefill (``decode_drafts`` None) or a decode row."""
    decode = decode_drafts is not None
    return StepLayout([0] if decode else [], [decode_drafts] if decode else [], [], [0] * tokens, [0], [tokens - 1], [started], [0], [TABLE])


def test_a_module_that_copies_the_target_drafts_its_greedy_continuation(copy):
    target, module = copy
    expected = greedy_continuation(target, PROMPT, 4 * (K + 1))
    proposer = MTPProposer(target, module, K, 1, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    kv = PagedKVCache(target.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
    history = TokenHistory(1, 64, CPU)
    seq = torch.tensor([0])
    history.prompt_len[0] = len(PROMPT)

    def run(rows: list[tuple], step_layout: StepLayout, tokens: list[int], pending: int) -> list[int]:
        """The target's forward of ``rows``, the history as if it emitted ``tokens`` (every draft
        accepted), the proposer following; the drafts it keeps for the next step."""
        batch = build_forward_batch(rows, BLOCK_SIZE, CPU)
        hidden = target.hidden_states(batch, kv)
        history.tokens[0, : len(tokens)] = torch.tensor(tokens)
        history.length[0] = len(tokens)
        proposer.follow(history, ProposalStep(batch, proposer.stage(step_layout)), hidden, torch.tensor([pending]))
        return proposer.drafts[0].tolist()

    emitted = 1  # the prefill's token, pending
    drafts = run([(PROMPT, 0, TABLE, True)], layout(len(PROMPT), None, True), PROMPT + expected[:1], len(PROMPT) - 1)
    assert drafts == expected[1 : 1 + K]
    for _ in range(3):  # decode steps that accept every draft: the pending token and the K drafts
        staged_drafts, _ = proposer.propose(history, seq, K, history.width, ProposalStep(None, proposer.stage(layout(1 + K, K, False))))
        assert staged_drafts[0].tolist() == drafts
        length = len(PROMPT) + emitted
        inputs = expected[emitted - 1 : emitted + K]  # the pending token, then the drafts
        rows = [([token], length - 1 + j, TABLE, True) for j, token in enumerate(inputs)]
        emitted += 1 + K
        drafts = run(rows, layout(1 + K, K, False), PROMPT + expected[:emitted], K)
        assert drafts == expected[emitted : emitted + K]


def test_a_prompt_in_chunks_gets_the_drafts_of_the_prompt_at_once(tmp_path):
    """A random module (its ``h`` matters): the second chunk's first entry takes the target's hidden
    state that the first chunk kept, so chunked and whole prefills draft alike."""
    path = add_mtp_layer(write_tiny_checkpoint(tmp_path / "v3", family="deepseek_v3"))
    target, module = DecoderModel.from_path(path, torch.float32, CPU), MTPModule.from_path(path, torch.float32, CPU)

    def drafts_after(chunks: list[list[int]]) -> list[int]:
        proposer = MTPProposer(target, module, K, 1, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
        kv = PagedKVCache(target.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        history = TokenHistory(1, 64, CPU)
        history.prompt_len[0] = len(PROMPT)
        start = 0
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            batch = build_forward_batch([(chunk, start, TABLE, last)], BLOCK_SIZE, CPU)
            hidden = target.hidden_states(batch, kv)
            first_token = int(target.logits(hidden[-1:]).argmax()) if last else None
            history.tokens[0, : len(PROMPT) + 1] = torch.tensor(PROMPT + [first_token or 0])
            history.length[0] = len(PROMPT) + 1 if last else start + len(chunk)
            step = StepLayout([], [], [], [0] * len(chunk), [0], [len(chunk) - 1], [index == 0], [0] if last else [], [TABLE])
            proposer.follow(history, ProposalStep(batch, proposer.stage(step)), hidden, torch.tensor([len(chunk) - 1] if last else [], dtype=torch.int64))
            start += len(chunk)
        return proposer.drafts[0].tolist()

    whole = drafts_after([PROMPT])
    assert drafts_after([PROMPT[:5], PROMPT[5:]]) == whole
    assert drafts_after([PROMPT[:1], PROMPT[1:]]) == whole


def test_a_device_with_mtp_measures_its_step_costs_and_reports_the_method(tmp_path):
    """The start-up measurement (goodput) runs the module's drafting steps through the real executor."""
    import argparse

    from stageserve.device import assembly, flags

    path = add_mtp_layer(write_tiny_checkpoint(tmp_path / "v3", family="deepseek_v3"))
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--dtype", "float32", "--speculative-method", "mtp", "--num-speculative-tokens", "2",
                              "--max-num-seqs", "12"])
    built = assembly.build_core(args, path)
    try:
        reply = built.attach_reply
        assert reply.speculative_method == "mtp" and reply.num_speculative_tokens == 2
        assert {(cost.rows, cost.drafts) for cost in reply.step_costs} >= {(1, 0), (1, 1), (1, 2), (2, 2)}
        assert all(cost.seconds > 0 for cost in reply.step_costs)
        assert built.table.active_count() == 0
    finally:
        built.executor.close()
