"""The model's sampling defaults fill only what a request leaves unset."""

from __future__ import annotations

import json

import pytest

from stageserve.prepare.sampling_defaults import load_sampling_defaults, with_defaults
from stageserve.v1 import prepare_pb2


def test_generation_config_fills_what_the_request_leaves_unset(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_length": 4096, "eos_token_id": 2}))
    defaults = load_sampling_defaults(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (pytest.approx(0.6), pytest.approx(0.95), 20)
    assert not defaults.HasField("repetition_penalty") and not defaults.HasField("max_tokens")
    request = with_defaults(prepare_pb2.GenerateRequest(prompt="hi", temperature=0.0, stop=["x"]), defaults)
    assert (request.temperature, request.top_p, request.top_k, request.prompt, list(request.stop)) == (0.0, pytest.approx(0.95), 20, "hi", ["x"])


def test_no_config_or_a_greedy_one_sets_nothing(tmp_path):
    plain = prepare_pb2.GenerateRequest(prompt="hi")
    assert with_defaults(plain, load_sampling_defaults(tmp_path)) is plain
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert load_sampling_defaults(tmp_path).ByteSize() == 0
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_sampling_defaults(tmp_path)


def test_a_gguf_files_sampling_keys_fill_what_the_request_leaves_unset(tmp_path):
    import gguf

    from stageserve.model_files import embedded_model_path

    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    writer.add_float32("general.sampling.temp", 0.7)  # the keys llama.cpp's converter writes
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.1)
    writer.add_array("tokenizer.ggml.tokens", ["a"] * 1000)  # skipped, not decoded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    defaults = load_sampling_defaults(tmp_path / "m.gguf")
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty) == (pytest.approx(0.7), 40, pytest.approx(1.1))
    assert not defaults.HasField("top_p")
    assert load_sampling_defaults(embedded_model_path()).ByteSize() == 0  # it has none
