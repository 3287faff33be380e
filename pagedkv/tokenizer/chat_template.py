"""Chat templates rendered as transformers renders them, without transformers.

A template is compiled in a sandboxed jinja2 environment with transformers' settings (trim and
lstrip blocks, loop controls, a ``tojson`` that is plain ``json.dumps``, ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag), so a conversation renders to the same text, and
so encodes to the same ids, with either library.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


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


def render_chat(
    template: jinja2.Template,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: dict[str, Any],
) -> str:
    """The conversation rendered by ``template``, which also sees ``variables`` (special tokens,
    tools, ...).

    ``add_generation_prompt`` opens an assistant turn after the last message;
    ``continue_final_message`` instead leaves the last message open (the text ends with its
    content, the template's end-of-turn markup cut off) so the model continues it -- a
    "prefilled" answer. The two exclude each other, as in transformers.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt exclude each other")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"chat message {i} must be a dict with a 'role', got {message!r}")
    rendered = template.render(
        messages=_tagged_final_message(messages) if continue_final_message else messages,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    return _cut_at_tag(rendered) if continue_final_message else rendered


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


def read_chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The folder's template source: ``chat_template.jinja`` when present, else the
    ``chat_template`` of tokenizer_config.json (its ``default`` entry when it names several)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template
