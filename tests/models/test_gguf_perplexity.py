"""The real model's perplexity from its GGUF file equals transformers' on the same windows.

The text is English prose pagedkv ships (``tests/data/pride_and_prejudice.txt``, public domain),
encoded by the file's own tokenizer and cut into llama-perplexity's chunks, as ``pagedkv bench
quality --text FILE --llamacpp-chunks`` does; pagedkv scores them through its paged path with the
file's Q4_1 blocks kept, transformers in one float32 forward pass over the same windows of the
model it dequantized from that file (``gguf_file=``, the ``real_model`` folder). So a figure
``bench quality`` prints for a GGUF file is the file's model's perplexity, not an approximation
of it, and setting it beside ``llama-perplexity -c 128`` compares like with like.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pagedkv import LLM
from pagedkv.bench.quality import QualityConfig
from pagedkv.bench.quality_text import HeldOut
from pagedkv.engine.perplexity import Perplexity, window_logprobs
from tests.real_model import ENGINE_OPTIONS, GGUF_FILE, gguf_path

TEXT = Path(__file__).resolve().parents[1] / "data" / "pride_and_prejudice.txt"
N_CTX = 128
#: Chunks scored (of the text's 36): enough to average over, few enough for a fast test.
NUM_CHUNKS = 8


def _transformers_logprobs(folder: Path, windows) -> list[list[float]]:
    """The scored tokens' logprobs of each window, all windows in one batch."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([w.token_ids for w in windows])
    with torch.no_grad():
        logprobs = model(ids).logits[:, :-1].log_softmax(-1)
    picked = logprobs.gather(-1, ids[:, 1:, None])[..., 0]
    return [row[w.scored_from - 1 :].tolist() for row, w in zip(picked, windows, strict=True)]


def test_gguf_perplexity_on_english_text_equals_transformers(tmp_path, real_model):
    (tmp_path / GGUF_FILE).symlink_to(gguf_path())
    gguf = str(tmp_path / GGUF_FILE)
    config = QualityConfig(text=str(TEXT), llamacpp_chunks=True, window=N_CTX)
    text = HeldOut.from_file(gguf, TEXT)
    every = config.windows(text)
    assert text.bos is None and len(every) == len(text.documents[0]) // N_CTX >= 30  # no BOS added
    windows = every[:NUM_CHUNKS]
    with LLM(gguf, **ENGINE_OPTIONS) as llm:
        assert text.documents[0] == llm.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
        engine_scores = window_logprobs(llm.engine, windows)
    reference = _transformers_logprobs(real_model, windows)
    for got, expected in zip(engine_scores, reference, strict=True):
        assert got == pytest.approx(expected, abs=1e-4)
    result, expected = Perplexity.of(engine_scores), Perplexity.of(reference)
    assert result.num_tokens == len(windows) * (N_CTX - N_CTX // 2 - 1)
    assert result.perplexity == pytest.approx(expected.perplexity, rel=1e-5)
    assert 8 < result.perplexity < 60  # English a small chat model reads well, far below its vocabulary
