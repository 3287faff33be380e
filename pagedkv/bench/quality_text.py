"""The text ``pagedkv bench quality`` scores: the built-in model's held-out stdlib files, or a text
file, as the model's own tokenizer (a folder's or a GGUF file's) encodes it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.tokenizer import Tokenizer


@dataclass
class HeldOut:
    """The text scored: its files, their token ids (the held-out files: BOS first, EOS last, as in
    training; a text file: as the tokenizer encodes it), and the BOS the tokenizer puts first
    (None when it adds none), which llama-perplexity's chunks begin with."""

    files: list[str]
    chars: int
    documents: list[list[int]]
    bos: int | None = None

    @classmethod
    def load(cls, model: str | None, max_chars: int | None) -> HeldOut:
        """The first ``max_chars`` characters of the held-out files (None: all of them; the last
        file read may be cut) as ``model``'s tokenizer encodes them (None: the built-in model's)."""
        from pagedkv.models import ModelConfig
        from pagedkv.models.builtin.train import stdlib_text

        path, tokenizer = _model_tokenizer(model)
        eos = ModelConfig.from_pretrained(path).eos_token_ids[0]
        files, texts, total = [], [], 0
        for relpath in stdlib_text.split_files()[1]:
            if max_chars is not None and total >= max_chars:
                break
            (text,) = stdlib_text.read_sources([relpath])
            text = text if max_chars is None else text[: max_chars - total]
            files.append(relpath)
            texts.append(text)
            total += len(text)
        documents = [tokenizer.encode(text) + [eos] for text in texts]
        return cls(files, total, documents, _added_bos(tokenizer))

    @classmethod
    def from_file(cls, model: str | None, file: Path) -> HeldOut:
        """The UTF-8 text of ``file``, one document, as ``model``'s tokenizer encodes it (special
        tokens added, as llama-perplexity tokenizes its ``-f`` file)."""
        _, tokenizer = _model_tokenizer(model)
        text = file.read_text(encoding="utf-8")
        return cls([str(file)], len(text), [tokenizer.encode(text)], _added_bos(tokenizer))

    def prompts(self, count: int, length: int) -> list[list[int]]:
        """``count`` prompts of ``length`` tokens, evenly spaced over the held-out documents'
        consecutive ``length``-token pieces (fewer if there are fewer pieces)."""
        pieces = [
            ids[i : i + length] for ids in self.documents for i in range(0, len(ids) - length + 1, length)
        ]
        return pieces if len(pieces) <= count else [pieces[i * len(pieces) // count] for i in range(count)]


def _model_tokenizer(model: str | None) -> tuple[Path, Tokenizer]:
    """``model``'s path (None: the built-in model) and its tokenizer (a folder's or a GGUF file's)."""
    from pagedkv.models import builtin_model_path
    from pagedkv.tokenizer import NoTokenizer, engine_tokenizer

    path = builtin_model_path() if model is None else Path(model)
    tokenizer = engine_tokenizer(path)
    if isinstance(tokenizer, NoTokenizer):
        raise ValueError(f"{path} has no tokenizer: perplexity needs one to encode the text")
    return path, tokenizer


def _added_bos(tokenizer: Tokenizer) -> int | None:
    """The token ``tokenizer`` puts before a text's own when adding special tokens, if any."""
    with_special, bare = tokenizer.encode("a"), tokenizer.encode("a", add_special_tokens=False)
    return with_special[0] if with_special[1:] == bare else None
