"""A conversation to prompt text: which chat template renders it, with which variables.

``/v1/chat/completions``, its render route and ``/tokenize`` with ``messages`` all render a
conversation here, so a tokenized conversation is exactly the prompt a chat runs. The template is,
first found: the request's ``chat_template`` (vLLM refuses it unless the server runs with
``--trust-request-chat-template``: a template is code the server runs, sandboxed or not), the
server's ``--chat-template``, the model's own. ``chat_template_kwargs`` reach the template as
variables (Qwen3's ``enable_thinking``, ...); a key naming one of the arguments the server itself
passes (``messages``, ``add_generation_prompt``, ``tools``, ...) is refused with a 400 naming it
rather than left to override them.
"""

from __future__ import annotations

from typing import Any, Protocol

import jinja2

from pagedkv.server.chat_protocol import ChatMessage
from pagedkv.server.errors import APIError
from pagedkv.server.tools import ChatTool
from pagedkv.tokenizer import Tokenizer

#: What the server passes to every template (and transformers' own arguments, and the helpers
#: templates call): never a kwarg.
RESERVED_TEMPLATE_KWARGS = (
    "messages", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "chat_template", "tokenize", "raise_exception", "strftime_now",
)  # fmt: skip


class ChatPromptRequest(Protocol):
    """The fields of a request that say how its conversation is rendered."""

    messages: list[ChatMessage]
    add_generation_prompt: bool | None
    continue_final_message: bool | None
    tools: list[ChatTool] | None
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None


def check_chat_options(body: ChatPromptRequest, trust_request_chat_template: bool) -> None:
    """The cheap checks of the rendering options (no template runs); :class:`APIError` if refused."""
    if body.continue_final_message and body.add_generation_prompt is not False:
        raise APIError.bad_request(
            "continue_final_message and add_generation_prompt cannot both be true (add_generation_prompt "
            "is true unless sent as false)",
            param="continue_final_message",
        )
    if body.chat_template is not None and not trust_request_chat_template:
        raise APIError.bad_request(
            "chat_template is refused: this server runs only its own chat template (start it with "
            "--trust-request-chat-template to accept one from requests)",
            param="chat_template",
        )
    for key in body.chat_template_kwargs or {}:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError.bad_request(
                f"chat_template_kwargs must not set {key!r}: the server passes it to the template itself",
                param=f"chat_template_kwargs.{key}",
            )


def render_conversation(
    tokenizer: Tokenizer, server_template: str | None, body: ChatPromptRequest, messages: list[dict[str, Any]]
) -> str:
    """``messages`` (the request's, as templates expect them) rendered to prompt text. Whatever
    the template raises is the request's doing (its messages, its kwargs, maybe its template): a
    400, never a 500. The tools reach the template as transformers passes them:
    ``tools``, OpenAI's tool objects. Blocking: run it on the tokenizer thread."""
    variables: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if body.tools:
        variables["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    template = body.chat_template if body.chat_template is not None else server_template
    try:
        return tokenizer.apply_chat_template(
            messages,
            body.add_generation_prompt is not False,
            bool(body.continue_final_message),
            chat_template=template,
            **variables,
        )
    except jinja2.TemplateSyntaxError as err:  # only a request's template can be new here
        raise APIError.bad_request(
            f"chat_template is not a valid template: {err}", param="chat_template"
        ) from None
    except Exception as err:  # the template runs on the request's data (and maybe is the request's)
        raise APIError.bad_request(
            f"the chat template failed on these messages: {type(err).__name__}: {err}", param="messages"
        ) from None
