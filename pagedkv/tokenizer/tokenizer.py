"""The tokenizer of a Hugging Face folder or a GGUF file, without transformers.

``tokenizer.json`` is run by the ``tokenizers`` library (the same Rust code transformers' fast
tokenizers wrap); ``tokenizer_config.json`` supplies the special tokens and the chat template
(rendered by :mod:`pagedkv.tokenizer.chat_template`), so a prompt encodes to the same ids with
either library. A GGUF file's metadata makes the same three parts
(:mod:`pagedkv.tokenizer.gguf_tokenizer`). A folder without ``tokenizer.json`` runs with a
:class:`NoTokenizer`: token ids in, token ids out.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from pagedkv.tokenizer.chat_template import compile_chat_template, read_chat_template, render_chat
from pagedkv.tokenizer.detokenizer import IncrementalDetokenizer
from pagedkv.tokenizer.gguf_file import gguf_parts
from pagedkv.tokenizer.gguf_tokenizer import read_gguf_tokenizer

#: The special-token names transformers exposes to chat templates.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer:
    """Text <-> ids, end-of-sequence ids and the chat template of one model."""

    has_text = True

    def __init__(
        self,
        backend: BackendTokenizer,
        special_tokens: dict[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        #: e.g. {"bos_token": "<s>", "eos_token": "</s>"}: the names chat templates see.
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.bos_token_id = self._token_id("bos_token")
        eos = self._token_id("eos_token")
        self.eos_token_id: int | None = eos
        #: every id that ends generation: the tokenizer's eos plus config/generation_config's.
        self.eos_token_ids: set[int] = set(extra_eos_token_ids) | ({eos} if eos is not None else set())
        self._template: jinja2.Template | None = None
        self._override: tuple[str, jinja2.Template] | None = None

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer_config.json names {name}={token!r}, which is not in tokenizer.json")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        *,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The conversation rendered to prompt text (``kwargs`` reach the template as variables:
        tools, or a model's own switches such as Qwen3's ``enable_thinking``); see
        :func:`~pagedkv.tokenizer.chat_template.render_chat` for the two flags. ``chat_template``
        (Jinja source) replaces the model's template for this call."""
        template = self._compiled(chat_template)
        variables = {**self.special_tokens, **kwargs}
        return render_chat(template, messages, add_generation_prompt, continue_final_message, variables)

    def _compiled(self, source: str | None) -> jinja2.Template:
        """The model's template, or ``source`` compiled (the last one kept: a server with
        ``--chat-template`` sends the same source every time)."""
        if source is None:
            if self.chat_template is None:
                raise ValueError(
                    "this tokenizer has no chat template (tokenizer_config.json or chat_template.jinja); "
                    "give one (chat_template, --chat-template)"
                )
            if self._template is None:
                self._template = compile_chat_template(self.chat_template)
            return self._template
        if self._override is None or self._override[0] != source:
            self._override = (source, compile_chat_template(source))
        return self._override[1]

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids of a conversation; like transformers, the template places any BOS itself."""
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> IncrementalDetokenizer:
        """A streaming decoder for tokens generated after ``prompt_ids``: on the backend's own
        ``decode`` (its windows are lists already), twice a generated token. See
        :mod:`pagedkv.tokenizer.detokenizer` for ``spaces_between_special_tokens``."""
        added = None if spaces_between_special_tokens or skip_special_tokens else self.added_tokens
        return IncrementalDetokenizer(self.backend.decode, prompt_ids, skip_special_tokens, added)

    @functools.cached_property
    def added_tokens(self) -> dict[int, str]:
        """Id -> content of every added token (special or not), as vLLM's detokenizer reads them."""
        return {i: token.content for i, token in self.backend.get_added_tokens_decoder().items()}


class NoTokenizerError(ValueError):
    """Text was to be encoded or decoded, but the engine runs without a tokenizer."""


class NoTokenizer:
    """Stands in for the tokenizer of a folder that has none, or when ``skip_tokenizer_init``
    is set (vLLM's name): prompts are token ids, outputs carry token ids and empty text, and only
    what needs text (a text prompt, a chat template, stop strings) fails, saying why."""

    has_text = False
    bos_token_id = eos_token_id = chat_template = None

    def __init__(self, reason: str, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.reason = reason
        self.special_tokens: dict[str, str] = {}
        self.eos_token_ids: set[int] = set(extra_eos_token_ids)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise NoTokenizerError(f"{self.reason}: text cannot be encoded or decoded; send token ids")

    encode = decode = apply_chat_template = encode_chat = _refuse

    def detokenizer(self, *args: Any, **kwargs: Any) -> _NoText:
        """Takes :meth:`Tokenizer.detokenizer`'s arguments: without text, none of them matters."""
        return _NoText()


class _NoText:
    """The detokenizer of :class:`NoTokenizer`: every generated token adds no text."""

    def push(self, token_ids: int | Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def engine_tokenizer(path: str | Path, skip_tokenizer_init: bool = False) -> Tokenizer | NoTokenizer:
    """The tokenizer of a model folder (its tokenizer.json) or of a GGUF model (its metadata:
    :mod:`pagedkv.tokenizer.gguf_tokenizer`), or a :class:`NoTokenizer` when asked to skip it or
    there is none (end-of-sequence ids still come from config.json or generation_config.json)."""
    folder = Path(path)
    if skip_tokenizer_init:
        return NoTokenizer("skip_tokenizer_init is set", _config_eos_ids(folder))
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    parts = gguf_parts(folder)
    if parts is None:
        return NoTokenizer(f"no tokenizer.json in {folder}", _config_eos_ids(folder))
    built = read_gguf_tokenizer(parts[0])
    if built is None:
        return NoTokenizer(f"{parts[0]} has no tokenizer metadata", ())
    return Tokenizer(*built)


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids(raw: dict[str, Any]) -> list[int]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def read_generation_config(folder: str | Path) -> dict[str, Any]:
    """A model folder's generation_config.json ({} without one): its ``eos_token_id`` ends
    generation here, its sampling fields are the model's defaults (``pagedkv.models.generation_config``)."""
    return _read_json(Path(folder) / "generation_config.json")


def _config_eos_ids(folder: Path) -> list[int]:
    """The ``eos_token_id`` of config.json and generation_config.json (chat models list several)."""
    return _eos_ids(_read_json(folder / "config.json")) + _eos_ids(read_generation_config(folder))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder (tokenizer.json + tokenizer_config.json).

    End-of-sequence ids gather the tokenizer's ``eos_token`` and the ``eos_token_id`` of
    config.json and generation_config.json (chat models often list several there).
    """
    folder = Path(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {folder}: pagedkv needs a fast (tokenizers) tokenizer file"
        )
    backend = BackendTokenizer.from_file(str(file))
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    special: dict[str, str] = {}
    for name in SPECIAL_TOKEN_NAMES:
        token = _token_content(config.get(name)) or _token_content(special_map.get(name))
        if token is not None:
            special[name] = token
    extra_eos = _config_eos_ids(folder)
    return Tokenizer(backend, special, read_chat_template(folder, config), extra_eos)
