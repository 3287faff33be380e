"""Perplexity through the engine's paged path equals transformers' on the same windows.

The text is held-out Python source (files the built-in model never trained on), longer than the
engine's context, so it is cut into sliding windows; the engine computes each window as a chunked
prompt with prompt logprobs, transformers in one forward pass per window, both in float32.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedkv import LLM
from pagedkv.engine.perplexity import (
    Perplexity,
    llamacpp_chunks,
    perplexity,
    sliding_windows,
    window_logprobs,
)
from pagedkv.models import builtin_model_path
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.builtin.train.windows import document_windows

WINDOW, STRIDE = 96, 64


@pytest.fixture(scope="module")
def documents() -> list[list[int]]:
    """The first 1,500 characters of two held-out stdlib files, encoded as the training script
    encodes documents (EOS last)."""
    llm = LLM(dtype="float32", num_kv_blocks=8)
    _, heldout = stdlib_text.split_files()
    texts = [text[:1_500] for text in stdlib_text.read_sources(heldout[:2])]  # two documents
    eos = llm.engine.model_config.eos_token_ids[0]
    return [llm.tokenizer.encode(text) + [eos] for text in texts]


def _transformers_logprobs(windows) -> list[list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(builtin_model_path(), dtype=torch.float32)
    scored = []
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w.token_ids])
            logprobs = model(ids).logits[0, :-1].float().log_softmax(-1)
            picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            scored.append(picked[w.scored_from - 1 :].tolist())
    return scored


def test_engine_perplexity_equals_transformers_on_held_out_text(documents):
    assert sum(map(len, documents)) > 3 * WINDOW  # longer than the context: windows are needed
    windows = [w for ids in documents for w in sliding_windows(ids, WINDOW, STRIDE)]
    llm = LLM(dtype="float32", max_model_len=WINDOW + 1, max_num_batched_tokens=40, num_kv_blocks=256)
    engine_scores = window_logprobs(llm.engine, windows)
    reference = _transformers_logprobs(windows)
    for got, expected in zip(engine_scores, reference, strict=True):
        assert got == pytest.approx(expected, abs=1e-4)
    result, expected = Perplexity.of(engine_scores), Perplexity.of(reference)
    assert result.num_tokens == sum(len(ids) - 1 for ids in documents)  # each token once but the first
    assert result.perplexity == pytest.approx(expected.perplexity, rel=1e-5)
    assert 5 < result.perplexity < 200  # a trained model: far below the vocabulary's 2048
    assert llm.kv_stats()["blocks_used"] == 0


def test_a_window_longer_than_the_context_or_a_busy_engine_is_refused(documents):
    llm = LLM(dtype="float32", max_model_len=WINDOW, num_kv_blocks=64)
    with pytest.raises(ValueError, match="does not fit: the engine's max_model_len 96"):
        perplexity(llm.engine, documents, WINDOW)
    llm.engine.add_request("busy", [5, 6, 7])
    with pytest.raises(RuntimeError, match="an engine with no requests"):
        perplexity(llm.engine, documents, 32)
    with pytest.raises(ValueError, match="stride must be"):
        sliding_windows([1, 2, 3], 4, 5)


@given(
    n=st.integers(0, 60),
    window=st.integers(2, 12),
    stride_fraction=st.floats(0.01, 1.0),
)
def test_windows_score_every_token_once_with_the_promised_context(n, window, stride_fraction):
    stride = max(1, round(window * stride_fraction))
    ids = list(range(100, 100 + n))
    scored = []
    for w in sliding_windows(ids, window, stride):
        begin = w.token_ids[0] - 100
        assert w.token_ids == ids[begin : begin + len(w.token_ids)] and len(w.token_ids) <= window
        assert w.scored_from >= (1 if begin == 0 else max(1, window - stride)) and w.num_scored > 0
        scored += range(begin + w.scored_from, begin + len(w.token_ids))
    # Sliding: every token but the first, once. Non-overlapping: not the windows' first tokens.
    assert scored == [p for p in range(1, n) if stride < window or p % window]
    if stride == window:
        assert [w.token_ids for w in sliding_windows(ids, window)] == document_windows([ids], window)


@given(n=st.integers(8, 90), n_ctx=st.integers(4, 16), bos=st.sampled_from([None, 1]))
def test_llamacpp_chunks_score_the_second_half_of_each_whole_chunk(n, n_ctx, bos):
    """As llama-perplexity: ``n // n_ctx`` chunks, the tail left out; in each, the logits from
    position ``n_ctx // 2`` on score the token after them; BOS (if any) replaces the first token."""
    ids = list(range(100, 100 + n))
    if n < 2 * n_ctx:
        with pytest.raises(ValueError, match=f"the text has {n} tokens: .* chunks of {n_ctx} need"):
            llamacpp_chunks(ids, n_ctx, bos)
        return
    chunks = llamacpp_chunks(ids, n_ctx, bos)
    assert len(chunks) == n // n_ctx
    for i, chunk in enumerate(chunks):
        whole = ids[i * n_ctx : (i + 1) * n_ctx]
        assert chunk.token_ids == (whole if bos is None else [bos, *whole[1:]])
        assert chunk.scored_from == n_ctx // 2 + 1 and chunk.num_scored == n_ctx - n_ctx // 2 - 1
