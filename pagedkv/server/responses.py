"""The OpenAI response shapes the server sends (pydantic models), errors included.

Responses follow OpenAI's API with vLLM's additions where vLLM has them (``prompt_logprobs`` on
a completion choice and on a chat response, a chat answer's ``reasoning_content``); a chat
answer that calls tools carries ``tool_calls`` as the OpenAI clients read them: an id,
``type: "function"``, the function's name and its arguments as JSON text, and in a stream one
delta per call with its ``index``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (null for an echoed
    prompt's first token, which nothing predicts)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob``: one candidate token at a prompt position."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended a ``stop`` finish (null: EOS or none).
    stop_reason: int | str | None = None
    #: vLLM's shape: per prompt token, None for the first, else candidates by token id (the
    #: prompt's own token first, then the top ``prompt_logprobs``); in a stream, on a choice's
    #: first chunk only.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class _Envelope(BaseModel):
    """OpenAI's envelope of a generation answer, its fields in OpenAI's order: each answer
    narrows ``object`` to its kind and ``choices`` to its choice type (a field a subclass
    declares again keeps its place here)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Any]
    usage: Usage | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    #: The arguments as JSON text (OpenAI's shape: the client parses it).
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of the ``index``-th tool call: its first carries the id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    #: The text answer; null when the answer is only tool calls (or, with a reasoning parser, only
    #: reasoning).
    content: str | None
    #: With --reasoning-parser: the answer's thinking (null when it has none).
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended a ``stop`` finish (null: EOS or none).
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    #: vLLM's, with the request's ``prompt_logprobs``: as a completion choice's.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    #: vLLM's: the stop string or stop token id that ended a ``stop`` finish (null: EOS or none).
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedkv"
    root: str
    #: the base model's name for a LoRA adapter; None for the base model (vLLM's)
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the server sends has this shape (OpenAI's)."""

    error: ErrorDetail


class HealthStatus(BaseModel):
    """``/health``: "ok" with 200, or why not with 503."""

    status: str
