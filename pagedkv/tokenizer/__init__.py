"""Text <-> token ids: the tokenizer of a Hugging Face folder, its chat template, streaming
detokenization, and the byte-level BPE recipe of the models pagedkv makes itself.

Nothing here knows of models or tensors: the engine, the server and the benchmarks take a
:class:`Tokenizer` (or a :class:`NoTokenizer` when a folder has none) from
:func:`engine_tokenizer` / :func:`load_tokenizer`.
"""

from pagedkv.tokenizer.detokenizer import IncrementalDetokenizer
from pagedkv.tokenizer.tokenizer import (
    NoTokenizer,
    NoTokenizerError,
    Tokenizer,
    engine_tokenizer,
    load_tokenizer,
)

__all__ = [
    "IncrementalDetokenizer",
    "NoTokenizer",
    "NoTokenizerError",
    "Tokenizer",
    "engine_tokenizer",
    "load_tokenizer",
]
