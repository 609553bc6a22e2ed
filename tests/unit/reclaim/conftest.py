"""Fixtures shared by reclaim's unit tests: the embedded model's real tokenizer, loaded once (~5 s)."""

from __future__ import annotations

import pytest

from stageserve.model_files import embedded_model_path
from stageserve.reclaim.detokenizer import IncrementalDetokenizer, decoder_for
from stageserve.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(embedded_model_path())


@pytest.fixture(scope="session")
def detokenizer(tokenizer) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(decoder_for(tokenizer))
