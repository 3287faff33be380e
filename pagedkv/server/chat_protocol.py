"""The chat completion request (``POST /v1/chat/completions``) and its messages; what it shares
with the completion request (sampling fields, refusals, strict scalars) is
:class:`~pagedkv.server.protocol.SamplingRequest`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from pagedkv.engine import SamplingParams
from pagedkv.server.errors import APIError
from pagedkv.server.protocol import Bool, Int, SamplingRequest
from pagedkv.server.structured import Constraint
from pagedkv.server.tools import ChatTool, ToolChoice


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    #: An assistant message's calls (OpenAI's shape: arguments as JSON text).
    tool_calls: list[dict[str, Any]] | None = None
    #: A ``tool`` message: the call it answers.
    tool_call_id: str | None = None

    def as_template_dict(self, path: str = "messages") -> dict[str, Any]:
        """The message as chat templates expect it: text content, and tool calls whose JSON
        arguments are decoded into objects (as vLLM and transformers give them). ``path`` is
        where the message sits in the request (``messages.2``): a ``tool`` message without
        ``tool_call_id``, or a call whose ``function.arguments`` is not the JSON text of an
        object, is a 400 naming the field under it."""
        if self.role == "tool" and not self.tool_call_id:
            raise APIError.bad_request(
                f"{path}.tool_call_id is required: a tool message answers the call with that id",
                param=f"{path}.tool_call_id",
            )
        content = self.content
        if isinstance(content, list):
            kinds = sorted({part.type for part in content if part.type != "text"})
            if kinds:
                raise APIError.bad_request(
                    f"only text content parts are supported, got {', '.join(kinds)}", param="messages"
                )
            content = "".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                _decoded_arguments(call, f"{path}.tool_calls.{i}") for i, call in enumerate(self.tool_calls)
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _decoded_arguments(call: dict[str, Any], path: str) -> dict[str, Any]:
    """``call`` (OpenAI's shape, at ``path``) with ``function.arguments`` decoded from the JSON
    text of an object; anything else is a 400 naming the field."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError.bad_request(
            f'{path}.function must be an object with a "name" and "arguments"', param=f"{path}.function"
        )
    field = f"{path}.function.arguments"
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise APIError.bad_request(f"{field} must be the JSON text of an object, as a string", param=field)
    try:
        decoded = json.loads(arguments)
    except (ValueError, RecursionError) as err:
        raise APIError.bad_request(f"{field} is not JSON text: {err}", param=field) from None
    if not isinstance(decoded, dict):
        raise APIError.bad_request(
            f"{field} must be the JSON text of an object, got {type(decoded).__name__}", param=field
        )
    return {**call, "function": {**function, "arguments": decoded}}


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered by the model's chat template (its
    options, ``echo`` and the answer's role: :mod:`pagedkv.server.preprocess`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    echo: Bool | None = False
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = False
    #: Add the tokenizer's special tokens on top of what the chat template writes.
    add_special_tokens: Bool | None = False
    tools: list[ChatTool] | None = None
    #: "none", "auto" (the default with tools), "required" or a named function
    #: (:mod:`pagedkv.server.tools`).
    tool_choice: ToolChoice | None = None
    #: False: a forced call is one call.
    parallel_tool_calls: Bool | None = None
    #: Jinja source replacing the server's chat template for this request (vLLM's; needs
    #: --trust-request-chat-template).
    chat_template: str | None = None
    #: More variables for the chat template, e.g. Qwen3's ``{"enable_thinking": false}``.
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's: the prompt tokens' logprobs on the response (not with ``stream``).
    prompt_logprobs: Int | None = None

    _refused = (*SamplingRequest._refused, "functions", "function_call", "documents")

    @property
    def max_tokens_asked(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(
        self, default_max_tokens: int, constraint: Constraint | None = None, defaults: Mapping[str, Any] = {}
    ) -> SamplingParams:
        """``default_max_tokens`` applies when neither max token field is given (the rest of the
        context, as in vLLM, capped by the ``max_tokens`` of ``defaults``, the model's sampling
        defaults); ``constraint``: what :meth:`constraint` found."""
        self._refuse_unsupported()
        if self.stream and self.prompt_logprobs is not None:
            raise APIError.bad_request(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_tokens_asked
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))
        return self._sampling_params(
            max_tokens, logprobs, self.prompt_logprobs, constraint=constraint, defaults=defaults
        )
