"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, as vLLM serves them.

``/tokenize`` takes a text ``prompt`` (``add_special_tokens`` true by default), or a chat
``messages`` with chat's own rendering options (``add_generation_prompt``,
``continue_final_message``, ``chat_template``, ``chat_template_kwargs``, ``tools``;
``add_special_tokens`` false by default), and answers ``{"count", "max_model_len", "tokens",
"token_strs"}`` -- the token strings (the vocabulary's, e.g. ``"Ġworld"``) only with
``return_token_strs``. A conversation is rendered by :mod:`pagedkv.server.chat_prompt` and
tokenized as ``/v1/chat/completions`` tokenizes it, so ``count`` is that chat's
``usage.prompt_tokens``. Nothing is refused for its length: the answer says how long it is and
``max_model_len`` what fits. ``/detokenize`` decodes ``tokens`` (special tokens kept, as vLLM
does) to ``{"prompt"}``; an id outside the vocabulary is a 400.

Like the ``/v1`` routes, these two need the API key when the server has one: they make the
tokenizer work on bodies of up to ``--max-body-size``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Response
from pydantic import BaseModel, Field, Strict

from pagedkv import __version__
from pagedkv.server.chat_prompt import check_chat_options, render_conversation
from pagedkv.server.chat_protocol import ChatMessage
from pagedkv.server.errors import APIError
from pagedkv.server.ignored_fields import ignored_headers
from pagedkv.server.openapi import error_responses
from pagedkv.server.preprocess import ServingContext
from pagedkv.server.protocol import refuse_invalid_text
from pagedkv.server.tools import ChatTool
from pagedkv.tokenizer import Tokenizer

Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]


#: The fields that only a conversation has.
_CHAT_FIELDS = (
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
)  # fmt: skip


class TokenizeRequest(BaseModel):
    """A text ``prompt`` or a conversation (``messages`` and chat's rendering options)."""

    model_config = {"extra": "allow"}  # ignored, and said so (:mod:`pagedkv.server.ignored_fields`)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: Bool | None = True
    continue_final_message: Bool | None = False
    #: The tokenizer's special tokens (BOS) on top of the text: by default for a prompt, not for
    #: a conversation (whose template writes its own), as in vLLM.
    add_special_tokens: Bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: Bool | None = False

    def check_shape(self) -> None:
        """Exactly one of ``prompt`` and ``messages``; no conversation option with a prompt."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError.bad_request("give either prompt or messages (exactly one)", param="prompt")
        if self.prompt is not None:
            for name in _CHAT_FIELDS:
                if name in self.model_fields_set:
                    raise APIError.bad_request(f"{name} applies to messages, not to a prompt", param=name)

    @property
    def with_special_tokens(self) -> bool:
        if self.add_special_tokens is None:
            return self.prompt is not None
        return self.add_special_tokens


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    #: The vocabulary's string of each token, with ``return_token_strs`` (else null).
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = {"extra": "allow"}

    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


def _tokenize(ctx: ServingContext, body: TokenizeRequest) -> TokenizeResponse:
    """The body's token ids (on the tokenizer thread: the text scan and the template read it all)."""
    refuse_invalid_text(body)
    if body.messages is not None:
        messages = [m.as_template_dict() for m in body.messages]
        text = render_conversation(ctx.tokenizer, ctx.chat_template, body, messages)
    else:
        text = body.prompt
    ids = ctx.encoder.encode_text(text, body.with_special_tokens)
    strings = [ctx.tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strings)


def _check_ids(tokenizer: Tokenizer, ids: list[int]) -> None:
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < tokenizer.vocab_size:
            raise APIError.bad_request(
                f"tokens[{index}] = {token_id} is not a token id of this model (0 to "
                f"{tokenizer.vocab_size - 1})",
                param="tokens",
            )


def _json(answer: BaseModel, headers: dict[str, str]) -> Response:
    return Response(answer.model_dump_json(), media_type="application/json", headers=headers)


def install_tokenize_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Add ``/tokenize``, ``/detokenize`` and ``/version`` to ``app``."""

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 401, 413))
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        body.check_shape()
        if body.messages is not None:
            check_chat_options(body, ctx.trust_request_chat_template)
        answer = await ctx.encoder.run(_tokenize, ctx, body)
        return _json(answer, ignored_headers(body, f"tokenize-{uuid.uuid4().hex}"))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 401, 413))
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        _check_ids(ctx.tokenizer, body.tokens)
        prompt = ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return _json(
            DetokenizeResponse(prompt=prompt), ignored_headers(body, f"detokenize-{uuid.uuid4().hex}")
        )

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)
