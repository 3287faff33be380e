"""The built-in model's real tokenizer and one real grammar compiler (xgrammar) for these tests."""

from __future__ import annotations

import pytest

from pagedkv.engine.structured.compiler import GrammarCompiler, xgrammar_backend_factory
from pagedkv.models import ModelConfig, builtin_model_path
from pagedkv.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(builtin_model_path())


@pytest.fixture(scope="session")
def vocab_size():
    return ModelConfig.from_pretrained(builtin_model_path()).vocab_size


@pytest.fixture(scope="session")
def compiler(tokenizer, vocab_size):
    """Shared by the tests that only compile valid specs (its cache makes each spec compile once)."""
    with GrammarCompiler(
        xgrammar_backend_factory(tokenizer.backend, vocab_size, tokenizer.eos_token_ids)
    ) as c:
        yield c


@pytest.fixture
def make_compiler(tokenizer, vocab_size):
    """A fresh compiler with the given config (its own cache and limits), closed after the test."""
    made: list[GrammarCompiler] = []

    def make(config=None) -> GrammarCompiler:
        made.append(
            GrammarCompiler(
                xgrammar_backend_factory(tokenizer.backend, vocab_size, tokenizer.eos_token_ids), config
            )
        )
        return made[-1]

    yield make
    for c in made:
        c.close()
