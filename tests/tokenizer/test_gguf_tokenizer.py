"""The tokenizer a GGUF file describes encodes and decodes as transformers' GGUF tokenizer does:
a byte-level BPE (``gpt2``, split by GPT-2's, Qwen2's or Llama 3's pre-tokenizer as the file
names it) and a SentencePiece vocabulary with byte fallback (``llama``), special tokens kept
whole, BOS added as the file asks."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from gguf import GGUFWriter, TokenType
from tokenizers import SentencePieceBPETokenizer

from pagedkv.tokenizer import Tokenizer, engine_tokenizer
from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf

TEXTS = [
    "Hello world, hello again.",
    "  leading spaces and trailing  ",
    "<s>control tokens</s> stay whole",
    "Grüße aus Köln — 東京 🚀",
    "line one\nline two\ttab",
    "In 2024, 12345 items cost $6.78; don't 'quote' me",
]
CORPUS = [
    "hello world the quick brown fox jumps over the lazy dog",
    "world of words, hello again and again; the fox and the dog",
    "tokenizers learn merges from text like this sentence here",
] * 20


def add_sentencepiece_vocabulary(writer: GGUFWriter, folder: Path) -> None:
    """A SentencePiece (``llama``) vocabulary as llama.cpp writes one: ``<unk>``, ``<s>``,
    ``</s>``, the 256 byte tokens, then pieces scored best first."""
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(CORPUS, vocab_size=200, show_progress=False)
    vocab = trained.get_vocab()
    pieces = [p for p in sorted(vocab, key=vocab.__getitem__) if p != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    types += [TokenType.NORMAL] * len(pieces)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny model's GGUF file with each vocabulary kind."""
    root = tmp_path_factory.mktemp("vocab")
    folder = make_checkpoint(root, "llama")
    return {
        "gpt2": write_gguf(folder, root / "gpt2" / "m.gguf"),
        "gpt2-qwen2": write_gguf(folder, root / "qwen2" / "m.gguf", **{"tokenizer.ggml.pre": "qwen2"}),
        "gpt2-llama3": write_gguf(folder, root / "llama3" / "m.gguf", **{"tokenizer.ggml.pre": "llama-bpe"}),
        "llama": write_gguf(folder, root / "llama" / "m.gguf", vocabulary=add_sentencepiece_vocabulary),
    }


@pytest.fixture(scope="module", params=["gpt2", "gpt2-qwen2", "gpt2-llama3", "llama"])
def pair(request, files) -> tuple[Tokenizer, object]:
    """(pagedkv's tokenizer, transformers') of one GGUF file with that vocabulary kind."""
    file = files[request.param]
    ours = engine_tokenizer(file)
    theirs = transformers.AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    return ours, theirs


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_gguf_tokenizer(pair, text):
    ours, theirs = pair
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode(text, add_special_tokens=False) == theirs(text, add_special_tokens=False)["input_ids"]


def test_bos_is_added_as_the_file_asks(pair):
    ours, _ = pair
    assert ours.bos_token_id is not None
    assert ours.encode("hello")[0] == ours.bos_token_id


def test_a_llama_vocabulary_falls_back_to_bytes(files):
    tokenizer = engine_tokenizer(files["llama"])
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    rocket = "🚀".encode()
    assert ids[-len(rocket) :] == [3 + b for b in rocket]  # <0xF0> ... after <unk>, <s>, </s>
    assert tokenizer.decode(ids) == "🚀"
