"""The tokenizer and chat template of a Hugging Face folder, without transformers.

``tokenizer.json`` is run by the ``tokenizers`` library (the same Rust code transformers' fast
tokenizers wrap); ``tokenizer_config.json`` supplies the special tokens and the chat template,
which is rendered in a sandboxed jinja2 environment configured like transformers' own, so a
prompt renders and encodes to the same ids with either library.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from pagedkv.models.detokenizer import IncrementalDetokenizer

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
        **kwargs: Any,
    ) -> str:
        """The conversation rendered to prompt text (``kwargs`` reach the template, e.g. tools).

        ``add_generation_prompt`` opens an assistant turn after the last message;
        ``continue_final_message`` instead leaves the last message open (the text ends with its
        content, the template's end-of-turn markup cut off) so the model continues it -- a
        "prefilled" answer. The two exclude each other, as in transformers.
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"chat message {i} must be a dict with a 'role', got {message!r}")
        rendered = self._template.render(
            messages=_tagged_final_message(messages) if continue_final_message else messages,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return _cut_at_tag(rendered) if continue_final_message else rendered

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
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming decoder for tokens generated after ``prompt_ids``: on the backend's own
        ``decode`` (its windows are lists already), twice a generated token."""
        return IncrementalDetokenizer(self.backend.decode, prompt_ids, skip_special_tokens)


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

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> _NoText:
        return _NoText()


class _NoText:
    """The detokenizer of :class:`NoTokenizer`: every generated token adds no text."""

    def push(self, token_ids: int | Sequence[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


def engine_tokenizer(path: str | Path, skip_tokenizer_init: bool = False) -> Tokenizer | NoTokenizer:
    """The folder's tokenizer, or a :class:`NoTokenizer` when asked to skip it or the folder has
    no tokenizer.json (end-of-sequence ids still come from config/generation_config.json)."""
    folder = Path(path)
    if not skip_tokenizer_init and (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    reason = "skip_tokenizer_init is set" if skip_tokenizer_init else f"no tokenizer.json in {folder}"
    eos = _eos_ids(_read_json(folder / "config.json")) + _eos_ids(
        _read_json(folder / "generation_config.json")
    )
    return NoTokenizer(reason, eos)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


#: Appended to the final message so its end can be found in the rendered chat (transformers' tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged_final_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with :data:`_CONTINUE_TAG` after the final message's text."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str):
        raise ValueError("continue_final_message needs a final message with text content")
    return [*messages[:-1], {**messages[-1], "content": content + _CONTINUE_TAG}]


def _cut_at_tag(rendered: str) -> str:
    """``rendered`` up to the tag, as transformers cuts it: the content as the template wrote it,
    or right-stripped where the template trimmed the tag's trailing space."""
    if _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A template compiled with transformers' settings: sandboxed, trim/lstrip blocks, loop
    controls, json-dumping ``tojson``, ``raise_exception`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


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


def _config_eos_ids(folder: Path) -> list[int]:
    """The ``eos_token_id`` of config.json and generation_config.json (chat models list several)."""
    return _eos_ids(_read_json(folder / "config.json")) + _eos_ids(
        _read_json(folder / "generation_config.json")
    )


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


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
    return Tokenizer(backend, special, _chat_template(folder, config), extra_eos)
