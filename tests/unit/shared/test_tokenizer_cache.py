"""The tokenizer of a GGUF file, built from the file once and read back from the cache after."""

from __future__ import annotations

from stageserve.model_files import embedded_model_path
from stageserve.tokenizer import load_tokenizer

TEXTS = ["The capital of France is", "def fibonacci(n):\n    return n", "东京是日本的首都。", "<|im_start|>user\nhi<|im_end|>", "  spaces\tand\ttabs  "]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


def test_the_cached_tokenizer_encodes_decodes_and_templates_as_the_one_built_from_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = load_tokenizer(embedded_model_path())
    (cached_dir,) = (tmp_path / "stageserve" / "tokenizers").iterdir()
    assert (cached_dir / "tokenizer.json").is_file()
    cached = load_tokenizer(embedded_model_path())
    for text in TEXTS:
        ids = built.encode(text)
        assert cached.encode(text) == ids
        assert cached.decode(ids) == built.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == built.decode(ids, skip_special_tokens=True)
    for prompt in (True, False):
        assert cached.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == \
            built.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
    assert cached.get_vocab() == built.get_vocab()
    assert (cached.eos_token_id, cached.bos_token_id, cached.pad_token_id) == (built.eos_token_id, built.bos_token_id, built.pad_token_id)
    assert cached.all_special_tokens == built.all_special_tokens


def test_an_unwritable_cache_still_loads_from_the_file(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert load_tokenizer(embedded_model_path()).encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_reclaims_rust_tokenizer_decodes_as_transformers_does_without_importing_torch(tmp_path):
    """``load_fast_tokenizer`` (what reclaim loads), with an empty cache (it builds it) and then from
    the cache, in a fresh interpreter: the same decoded text, and torch never imported."""
    import json
    import os
    import subprocess
    import sys

    built = load_tokenizer(embedded_model_path())
    ids = [built.encode(text) for text in TEXTS]
    script = ("import json, sys\nfrom stageserve.model_files import embedded_model_path\n"
              "from stageserve.tokenizer import load_fast_tokenizer\n"
              "tokenizer = load_fast_tokenizer(embedded_model_path())\n"
              f"print(json.dumps([[tokenizer.decode(i, skip_special_tokens=s) for i in {ids!r}] for s in (True, False)] + ['torch' in sys.modules]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):  # the first builds the cache (transformers, and torch with it); the second reads it
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    plain, special, torch_imported = json.loads(out)
    assert plain == [built.decode(i, skip_special_tokens=True) for i in ids]
    assert special == [built.decode(i) for i in ids]
    assert torch_imported is False


def test_prepares_tokenizer_of_a_gguf_templates_as_autotokenizer_without_importing_torch(tmp_path):
    """``load_tokenizer`` from a GGUF's cache (what prepare loads after the first start), in a fresh
    interpreter: the chat template and encodings of ``AutoTokenizer``'s tokenizer, torch and
    xgrammar (structured output's parser, imported at the first constraint) never imported."""
    import json
    import os
    import subprocess
    import sys

    built = load_tokenizer(embedded_model_path())
    script = ("import json, sys\nfrom stageserve.model_files import embedded_model_path\n"
              "from stageserve.tokenizer import load_tokenizer\nimport stageserve.structured_output\n"
              "tokenizer = load_tokenizer(embedded_model_path())\n"
              f"print(json.dumps([tokenizer.encode(t) for t in {TEXTS!r}] + [tokenizer.apply_chat_template({CHAT!r}, tokenize=False,"
              " add_generation_prompt=True), type(tokenizer).__name__, 'torch' in sys.modules, 'xgrammar' in sys.modules]))")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):  # the first builds the cache (AutoTokenizer from the file, torch with it); the second reads it
        out = json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout)
    *encodings, template, class_name, torch_imported, xgrammar_imported = out
    assert encodings == [built.encode(text) for text in TEXTS]
    assert template == built.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert class_name == type(built).__name__
    assert (torch_imported, xgrammar_imported) == (False, False)


def test_a_gguf_s_cache_naming_a_model_s_class_loads_it_without_importing_torch(tmp_path):
    """A GGUF's cached tokenizer of a model's own class (``Qwen2Tokenizer``, as ``AutoTokenizer`` builds
    it from a Qwen GGUF; here one over the embedded file's vocabulary, saved in its cache): loaded as
    that class, in a fresh interpreter without torch, encoding and templating as the saved one."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from transformers import Qwen2Tokenizer

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    load = "from stageserve.model_files import embedded_model_path\nfrom stageserve.tokenizer import load_tokenizer\ntokenizer = load_tokenizer(embedded_model_path())\n"
    subprocess.run([sys.executable, "-c", load], env=env, check=True)  # builds the cache
    [cache] = tmp_path.glob("stageserve/tokenizers/*")
    qwen = Qwen2Tokenizer.from_pretrained(cache, local_files_only=True)
    shutil.rmtree(cache)
    qwen.save_pretrained(cache)
    script = load + (f"print(json.dumps([tokenizer.encode(t) for t in {TEXTS!r}] + [tokenizer.apply_chat_template({CHAT!r}, tokenize=False,"
                     " add_generation_prompt=True), type(tokenizer).__name__, 'torch' in sys.modules]))")
    *encodings, template, class_name, torch_imported = json.loads(
        subprocess.run([sys.executable, "-c", "import json, sys\n" + script], env=env, capture_output=True, text=True, check=True).stdout)
    assert encodings == [qwen.encode(text) for text in TEXTS]
    assert template == qwen.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (class_name, torch_imported) == ("Qwen2Tokenizer", False)


def test_a_folder_naming_a_hub_class_transformers_corrects_tokenizes_as_autotokenizer(tmp_path):
    """A Hugging Face folder whose ``tokenizer_config.json`` names ``LlamaTokenizerFast`` over a
    byte-level ``tokenizer.json`` (as some hub checkpoints do): ``AutoTokenizer`` loads it as the plain
    class, and so does ``load_tokenizer`` (the named class would split words differently)."""
    import json

    from transformers import AutoTokenizer

    folder = tmp_path / "hub-tokenizer"
    load_tokenizer(embedded_model_path()).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "LlamaTokenizerFast"}))
    auto = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    loaded = load_tokenizer(folder)
    assert [loaded.encode(text) for text in TEXTS] == [auto.encode(text) for text in TEXTS]
