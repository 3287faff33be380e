"""The two generation endpoints: requests to engine prompts, deltas to OpenAI responses.

Both endpoints validate everything (model name, sampling values, prompt length, cache fit,
queue room) *before* the response starts, so a refused request gets a real HTTP status rather
than a 200 stream with an error inside. Once streaming, the response is server-sent events,
one ``data: {chunk}`` per choice delta, an optional usage chunk, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

import jinja2
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagedkv.engine import InvalidRequestError, RequestLimits, SamplingParams
from pagedkv.engine.validation import check_context
from pagedkv.models import Tokenizer
from pagedkv.server.async_engine import Aborted, AsyncEngine
from pagedkv.server.errors import APIError, EngineRequestError
from pagedkv.server.generation import ChoiceDelta, Generation, collect_unless_disconnected
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.prompts import PromptEncoder
from pagedkv.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)

logger = logging.getLogger("pagedkv.server")


@dataclass
class ServingContext:
    """What the handlers need besides the request: shared by every request of one app."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    encoder: PromptEncoder
    model_name: str
    max_model_len: int
    #: Most tokens (prompt + output) one request can ever hold in the KV cache.
    kv_capacity_tokens: int
    #: What one request may ask for (the engine's limits, applied here to a batch as a whole).
    limits: RequestLimits
    max_prompts_per_request: int

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError.bad_request(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def check_size(self, num_prompts: int, params: SamplingParams) -> None:
        """The limits that need no tokens, checked before any prompt is tokenized."""
        if num_prompts > self.max_prompts_per_request:
            raise APIError.bad_request(
                f"the request has {num_prompts} prompts, over the limit max_prompts_per_request = "
                f"{self.max_prompts_per_request} (--max-prompts-per-request)",
                param="prompt",
            )
        try:
            self.limits.check_n(params.n)
            self.limits.check_stops(params)
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None

    def check_tokens(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Each prompt within the context, then samples x (prompt + max_tokens) summed over the
        prompts (what the whole batch asks for) within the limit; before anything is queued."""
        prompt_tokens = sum(len(p) for p in prompts)
        requested = params.n * (prompt_tokens + len(prompts) * params.max_tokens)
        outputs = f"{len(prompts)} x {params.max_tokens} max_tokens"
        try:
            for index, prompt in enumerate(prompts):
                try:
                    check_context(len(prompt), params.max_tokens, self.max_model_len)
                except InvalidRequestError as err:
                    prefix = f"prompt {index}: " if len(prompts) > 1 else ""
                    raise InvalidRequestError(f"{prefix}{err}", err.param) from None
            self.limits.check_tokens(
                requested, f"n = {params.n} x ({prompt_tokens} prompt tokens + {outputs})"
            )
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None


def _json(body: BaseModel) -> Response:
    """pydantic's JSON (a -inf logprob becomes null, where ``json.dumps`` would refuse it)."""
    return Response(body.model_dump_json(), media_type="application/json")


def _sse(chunk: BaseModel | dict) -> str:
    body = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {body}\n\n"


def _shows(delta: ChoiceDelta, wants_logprobs: bool) -> bool:
    """Whether a delta is worth a chunk: tokens whose text is held back (half a UTF-8
    character, a possible stop string) carry nothing to show unless logprobs were asked for."""
    return bool(delta.text) or delta.finish_reason is not None or (wants_logprobs and bool(delta.token_ids))


def _failure(err: Exception, request_id: str) -> APIError:
    """What a generation that failed after admission answers: a plain message and the request id
    (the exception itself is in the server log, under that id)."""
    if isinstance(err, Aborted):
        message = f"{err} (request id {request_id})"
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, type="server_error", code="aborted")
    if not isinstance(err, EngineRequestError):
        logger.error("request %s failed while streaming", request_id, exc_info=err)
    return APIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"the server failed on this request (request id {request_id}); the details are in its log",
        type="server_error",
        code="internal_error",
    )


async def _start(
    ctx: ServingContext, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> Generation:
    generation = Generation(ctx.engine, request_id, prompts, params)
    try:
        await generation.start()  # an APIError (a full queue) passes through as it is
    except Aborted as err:
        raise _failure(err, request_id) from None
    except InvalidRequestError as err:  # too long, never fits, bad token ids, over a limit
        raise APIError.from_value_error(err) from None
    return generation


async def _sse_events(generation: Generation, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame the chunks, end with ``[DONE]``; abort the generation if the client goes away.

    A failure after the response started can only be told in the stream: an error event (which
    the OpenAI clients raise as an ``APIError``) after the closing chunks of every open choice.
    """
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as err:
        yield _sse(_failure(err, generation.request_id).body())
    finally:
        generation.close()
    yield "data: [DONE]\n\n"


async def _respond(request: Request, generation: Generation) -> list[list[ChoiceDelta]]:
    try:
        return await collect_unless_disconnected(generation, request.receive)
    except (Aborted, EngineRequestError) as err:
        raise _failure(err, generation.request_id) from None
    finally:
        generation.close()


# -- /v1/completions ---------------------------------------------------------------------------
async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext) -> Response:
    ctx.check_model(body.model)
    params = body.sampling_params()
    texts = body.prompts()
    ctx.check_size(len(texts), params)  # first: a 200k-prompt list is refused before it is read
    body.check_text()
    try:
        prompts = [ctx.encoder.encode(p) for p in texts]
    except InvalidRequestError as err:
        raise APIError.from_value_error(err) from None
    ctx.check_tokens(prompts, params)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation = await _start(ctx, request_id, prompts, params)
    formatter = LogprobFormatter(ctx.tokenizer)
    wants_logprobs = params.logprobs is not None
    with_prompt_logprobs: set[int] = set()  # choices whose prompt logprobs went out

    def choice(delta: ChoiceDelta) -> CompletionChoice:
        logprobs = formatter.completion(delta.index, delta.logprobs) if wants_logprobs else None
        prompt_logprobs = generation.prompt_logprobs.get(delta.index // params.n)
        if prompt_logprobs is not None and delta.index not in with_prompt_logprobs:
            with_prompt_logprobs.add(delta.index)
            prompt_logprobs = formatter.prompt(prompt_logprobs)
        else:
            prompt_logprobs = None
        return CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            prompt_logprobs=prompt_logprobs,
        )

    created = int(time.time())
    if body.stream:

        async def chunks() -> AsyncIterator[str]:
            async for delta in generation.deltas():
                if not _shows(delta, wants_logprobs):
                    continue
                yield _sse(
                    CompletionResponse(
                        id=request_id, created=created, model=ctx.model_name, choices=[choice(delta)]
                    )
                )
            if body.include_usage:
                yield _sse(
                    CompletionResponse(
                        id=request_id,
                        created=created,
                        model=ctx.model_name,
                        choices=[],
                        usage=generation.usage,
                    )
                )

        return StreamingResponse(_sse_events(generation, chunks()), media_type="text/event-stream")

    per_choice = await _respond(request, generation)
    choices = []
    for deltas in per_choice:
        merged = [choice(d) for d in deltas]
        text = "".join(c.text for c in merged)
        logprobs = formatter.merge([c.logprobs for c in merged]) if wants_logprobs else None
        choices.append(
            CompletionChoice(
                index=deltas[-1].index,
                text=text,
                logprobs=logprobs,
                finish_reason=deltas[-1].finish_reason,
                prompt_logprobs=merged[0].prompt_logprobs,
            )
        )
    return _json(
        CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=generation.usage
        )
    )


# -- /v1/chat/completions ----------------------------------------------------------------------
def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    messages = [m.as_template_dict() for m in body.messages]
    try:
        return ctx.encoder.encode_chat(messages)
    except InvalidRequestError as err:  # provably longer than the context
        raise APIError.from_value_error(err) from None
    except (ValueError, jinja2.TemplateError) as err:
        raise APIError.bad_request(
            f"the chat template failed on these messages: {err}", param="messages"
        ) from None


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    body.check_text()
    ctx.check_model(body.model)
    prompt = chat_prompt(ctx, body)
    # Without max_tokens a chat runs to the end of the context (vLLM's default), within the limits.
    samples = body.n if isinstance(body.n, int) and body.n > 0 else 1
    ceiling = min(ctx.max_model_len, ctx.kv_capacity_tokens, ctx.limits.max_request_tokens // samples)
    params = body.sampling_params(default_max_tokens=max(ceiling - len(prompt), 1))
    ctx.check_size(1, params)
    ctx.check_tokens([prompt], params)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await _start(ctx, request_id, [prompt], params)
    formatter = LogprobFormatter(ctx.tokenizer)
    wants_logprobs = params.logprobs is not None

    def logprobs(delta: ChoiceDelta) -> ChatLogprobs | None:
        return ChatLogprobs(content=formatter.chat(delta.logprobs)) if wants_logprobs else None

    created = int(time.time())
    if body.stream:

        def chunk(choice: ChatStreamChoice | None, usage=None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=request_id,
                    created=created,
                    model=ctx.model_name,
                    choices=[choice] if choice else [],
                    usage=usage,
                )
            )

        async def chunks() -> AsyncIterator[str]:
            for index in range(generation.num_choices):
                yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(role="assistant", content="")))
            async for delta in generation.deltas():
                if not _shows(delta, wants_logprobs):
                    continue
                yield chunk(
                    ChatStreamChoice(
                        index=delta.index,
                        delta=ChatDelta(content=delta.text),
                        logprobs=logprobs(delta),
                        finish_reason=delta.finish_reason,
                    )
                )
            if body.include_usage:
                yield chunk(None, usage=generation.usage)

        return StreamingResponse(_sse_events(generation, chunks()), media_type="text/event-stream")

    per_choice = await _respond(request, generation)
    choices = []
    for deltas in per_choice:
        content = [token for d in deltas for token in formatter.chat(d.logprobs)] if wants_logprobs else None
        choices.append(
            ChatChoice(
                index=deltas[-1].index,
                message=ChatResponseMessage(content="".join(d.text for d in deltas)),
                logprobs=ChatLogprobs(content=content) if content is not None else None,
                finish_reason=deltas[-1].finish_reason,
            )
        )
    return _json(
        ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=generation.usage
        )
    )
