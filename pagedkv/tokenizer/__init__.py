"""Text <-> token ids: the tokenizer of a Hugging Face folder (:mod:`.tokenizer`), its chat
template (:mod:`.chat_template`), streaming detokenization (:mod:`.detokenizer`), and the
byte-level BPE recipe of the checkpoints pagedkv writes itself (:mod:`.bpe`).

The package imports nothing else of pagedkv and no torch (the architecture test holds it to
that): the engine, the server and the benchmarks take a :class:`Tokenizer`, or a
:class:`NoTokenizer` when a folder has none, from :func:`engine_tokenizer` / :func:`load_tokenizer`.
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
