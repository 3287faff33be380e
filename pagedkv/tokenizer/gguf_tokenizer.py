"""The tokenizer a GGUF file describes in its metadata, built as a ``tokenizers`` pipeline.

A GGUF carries no tokenizer.json: llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``,
``.token_type``, ``.scores``, ``.merges``), its kind (``tokenizer.ggml.model``), the
pre-tokenizer's name (``.pre``), the special ids and whether BOS/EOS are added, and the chat
template. Two kinds are built, as transformers' GGUF converter builds them:

- ``gpt2``: byte-level BPE from the vocabulary and merges, split as the ``pre`` name says
  (llama.cpp's regexes: GPT-2's by default, Llama 3's, Qwen2's; digits one by one for
  SmolLM/StarCoder-style vocabularies, as llama.cpp and their own tokenizer.json do);
- ``llama``: SentencePiece BPE with byte fallback (``<0xNN>`` tokens), its merges recovered from
  the scores, a ``▁`` prefix before the first word unless ``add_space_prefix`` is false.

Tokens typed CONTROL become special added tokens and USER_DEFINED plain added ones, so both stay
whole in text. End of generation: the EOS id plus llama.cpp's end-of-turn/end-of-message ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagedkv.tokenizer.gguf_file import GGUFError, field, open_gguf

#: ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
CONTROL, USER_DEFINED = 3, 4

#: GGUF special-id keys -> the names chat templates see.
_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
#: Ids llama.cpp also ends generation on (end of turn, end of message).
_END_IDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
#: The metadata the tokenizer reads, all from the first part of a split model.
KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
    *_SPECIAL_IDS.values(),
    *_END_IDS,
)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` -> the regex llama.cpp splits with before BPE (others: GPT-2's).
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
#: Pre-tokenizers that put every digit apart before GPT-2's split (llama.cpp's ``\p{N}`` first).
_DIGIT_SPLITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")


#: What :class:`~pagedkv.tokenizer.tokenizer.Tokenizer` is made of: the backend, the special
#: tokens by name, the chat template and the ids that also end generation.
TokenizerParts = tuple[BackendTokenizer, dict[str, str], str | None, list[int]]


def read_gguf_tokenizer(file: Path) -> TokenizerParts | None:
    """The tokenizer of GGUF ``file`` (a split model's first part); None when the file has no
    vocabulary."""
    reader = open_gguf(file)
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    return gguf_tokenizer({key: field(reader, key, None, file) for key in KEYS}, file)


def gguf_tokenizer(meta: Mapping[str, Any], file: Path) -> TokenizerParts:
    """The tokenizer of metadata ``meta`` (the :data:`KEYS` read from ``file``, None when absent)."""
    kind = meta["tokenizer.ggml.model"]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: Sequence[int] = meta["tokenizer.ggml.token_type"] or ()
    if kind == "gpt2":
        if meta["tokenizer.ggml.merges"] is None:
            raise GGUFError(f"{file}: a gpt2 (byte-level BPE) vocabulary without tokenizer.ggml.merges")
        backend = _byte_level(tokens, meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.pre"])
        default_bos = False
    elif kind == "llama":
        if meta["tokenizer.ggml.scores"] is None:
            raise GGUFError(f"{file}: a llama (SentencePiece) vocabulary without tokenizer.ggml.scores")
        prefix = meta["tokenizer.ggml.add_space_prefix"] is not False
        backend = _sentencepiece(
            tokens, meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.unknown_token_id"], prefix
        )
        default_bos = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise GGUFError(
            f"{file}: unsupported tokenizer {kind!r} (tokenizer.ggml.model); "
            "pagedkv builds 'gpt2' and 'llama'"
        )
    _add_typed_tokens(backend, tokens, types, byte_level=kind == "gpt2")
    special = {
        name: tokens[meta[key]]
        for name, key in _SPECIAL_IDS.items()
        if meta[key] is not None and meta[key] < len(tokens)
    }
    add_bos = meta["tokenizer.ggml.add_bos_token"]
    add_bos = default_bos if add_bos is None else bool(add_bos)
    _add_bos_eos(backend, special, add_bos, bool(meta["tokenizer.ggml.add_eos_token"]))
    end_ids = [meta[key] for key in _END_IDS if meta[key] is not None]
    return backend, special, meta["tokenizer.chat_template"], end_ids


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> BackendTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # a token written outside the byte alphabet (a mislabelled special token) is respelled in it
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): i
        for i, token in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(
        models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _SPLITS.get(pre or "")
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(
    tokens: list[str], scores: list[float], unk_id: int | None, prefix: bool
) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
    backend = BackendTokenizer(
        models.BPE(
            vocab, _merges_from_scores(vocab, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece merges: every split of a token into two tokens, the token's score ranking
    it (higher first; ties: shorter left piece, then ids), as the SentencePiece extractor does."""
    merges = []
    for token, token_id in vocab.items():
        score = scores[token_id]
        pieces = [
            (token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        pieces.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, left, right) for left, right in pieces)
    merges.sort(key=lambda m: (-m[0], len(m[1]), len(m[2])))
    return [(left, right) for _, left, right in merges]


def _add_typed_tokens(
    backend: BackendTokenizer, tokens: list[str], types: Sequence[int], byte_level: bool
) -> None:
    """CONTROL tokens as special added tokens, USER_DEFINED ones as plain added tokens; in a
    byte-level vocabulary a control token spelled outside the byte alphabet is a mislabel,
    left alone (adding it would grow the vocabulary past the model's)."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and (alphabet is None or set(token) <= alphabet)
    ]
    user = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _add_bos_eos(backend: BackendTokenizer, special: dict[str, str], add_bos: bool, add_eos: bool) -> None:
    """A post-processor putting BOS before and EOS after each encoded text, as the file asks."""
    bos = special.get("bos_token") if add_bos else None
    eos = special.get("eos_token") if add_eos else None
    if bos is None and eos is None:
        return
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = f"{single} " + " ".join([*([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    ids = [(token, backend.token_to_id(token)) for token in (bos, eos) if token is not None]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: each byte as a printable character (printable ASCII and Latin-1
    as themselves, the rest shifted past 255)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    shift = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + shift)
            shift += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}
