"""The two generation endpoints: requests to engine prompts, deltas to OpenAI responses.

Both endpoints validate everything (model name, sampling values, prompt length, cache fit,
queue room; :mod:`pagedkv.server.preprocess`) *before* the response starts, so a refused request
gets a real HTTP status rather than a 200 stream with an error inside. Once streaming, the
response is server-sent events, one ``data: {chunk}`` per choice delta, an optional usage chunk,
then ``data: [DONE]``. ``echo`` (vLLM's) puts the prompt, or for chat the last message, before a
choice's first delta.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagedkv.engine import InvalidRequestError, SamplingParams
from pagedkv.server.async_engine import Aborted
from pagedkv.server.errors import APIError, EngineRequestError
from pagedkv.server.generation import ChoiceDelta, Generation, collect_unless_disconnected
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.preprocess import ServingContext, preprocess_chat, preprocess_completion
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
)
from pagedkv.server.tool_calls import AnswerTools

if TYPE_CHECKING:
    from pagedkv.engine.structured.xgrammar_backend import CompiledGrammar

__all__ = ["ServingContext", "create_chat_completion", "create_completion"]

logger = logging.getLogger("pagedkv.server")


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
    ctx: ServingContext,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    grammar: CompiledGrammar | None,
) -> Generation:
    generation = Generation(ctx.engine, request_id, prompts, params, priority, grammar)
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
    inputs = await preprocess_completion(ctx, body)
    params = inputs.params
    request_id = f"cmpl-{uuid.uuid4().hex}"
    generation = await _start(ctx, request_id, inputs.prompts, params, body.priority, inputs.grammar)
    formatter = LogprobFormatter(ctx.tokenizer)
    wants_logprobs = params.logprobs is not None
    with_prompt_logprobs: set[int] = set()  # choices whose prompt logprobs went out
    to_echo = set(range(generation.num_choices)) if inputs.echoes is not None else set()

    def choice(delta: ChoiceDelta) -> CompletionChoice:
        """A delta as a choice; a choice's first carries the echoed prompt and the prompt logprobs."""
        prompt_index = delta.index // params.n
        prompt_logprobs = generation.prompt_logprobs.get(prompt_index)
        complete = prompt_logprobs is not None and len(prompt_logprobs) == len(inputs.prompts[prompt_index])
        text = "" if body.echo_only else delta.text
        parts: list[CompletionLogprobs] = []
        if delta.index in to_echo:
            to_echo.discard(delta.index)
            text = inputs.echoes[prompt_index] + text
            if wants_logprobs and complete:  # incomplete: aborted before the prompt ran
                prompt = inputs.prompts[prompt_index]
                parts.append(formatter.echoed_prompt(delta.index, prompt, prompt_logprobs, params.logprobs))
        if wants_logprobs and not body.echo_only:
            parts.append(formatter.completion(delta.index, delta.logprobs))
        shown_prompt_logprobs = None
        if prompt_logprobs is not None and delta.index not in with_prompt_logprobs:
            with_prompt_logprobs.add(delta.index)
            shown_prompt_logprobs = formatter.prompt(prompt_logprobs)
        return CompletionChoice(
            index=delta.index,
            text=text,
            logprobs=formatter.merge(parts) if wants_logprobs else None,
            finish_reason=delta.finish_reason,
            prompt_logprobs=shown_prompt_logprobs,
        )

    def shows(delta: ChoiceDelta) -> bool:
        return delta.index in to_echo or _shows(delta, wants_logprobs and not body.echo_only)

    created = int(time.time())
    if body.stream:

        async def chunks() -> AsyncIterator[str]:
            async for delta in generation.deltas():
                if not shows(delta):
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
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    inputs = await preprocess_chat(ctx, body)
    prompt, params = inputs.prompt, inputs.params
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await _start(ctx, request_id, [prompt], params, body.priority, inputs.grammar)
    formatter = LogprobFormatter(ctx.tokenizer)
    wants_logprobs = params.logprobs is not None

    def logprobs(delta: ChoiceDelta) -> ChatLogprobs | None:
        return ChatLogprobs(content=formatter.chat(delta.logprobs)) if wants_logprobs else None

    answers = None  # each choice's tool calls, when the request has tools in play
    if inputs.tool_mode != "none":
        named = body.tool_choice.function.name if inputs.tool_mode == "named" else None
        one_call = body.parallel_tool_calls is False
        answers = [
            AnswerTools(inputs.tool_mode, ctx.tool_parser, named, one_call)
            for _ in range(generation.num_choices)
        ]

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
                yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(role=inputs.role, content="")))
            for index in range(generation.num_choices) if inputs.echo else ():
                yield chunk(ChatStreamChoice(index=index, delta=ChatDelta(content=inputs.echo)))
            async for delta in generation.deltas():
                if answers is None:
                    if not _shows(delta, wants_logprobs):
                        continue
                    content, calls, reason = delta.text, None, delta.finish_reason
                else:
                    content, calls, reason = answers[delta.index].stream(delta.text, delta.finish_reason)
                    says_nothing = content is None and calls is None and reason is None
                    if says_nothing and not (wants_logprobs and delta.token_ids):
                        continue
                yield chunk(
                    ChatStreamChoice(
                        index=delta.index,
                        delta=ChatDelta(content=content, tool_calls=calls),
                        logprobs=logprobs(delta),
                        finish_reason=reason,
                    )
                )
            if body.include_usage:
                yield chunk(None, usage=generation.usage)

        return StreamingResponse(_sse_events(generation, chunks()), media_type="text/event-stream")

    per_choice = await _respond(request, generation)
    choices = []
    for deltas in per_choice:
        tokens = [token for d in deltas for token in formatter.chat(d.logprobs)] if wants_logprobs else None
        text, reason = "".join(d.text for d in deltas), deltas[-1].finish_reason
        if answers is None:
            message = ChatResponseMessage(role=inputs.role, content=inputs.echo + text)
        else:
            content, calls, reason = answers[deltas[-1].index].complete(text, reason)
            content = inputs.echo + content if content is not None else (inputs.echo or None)
            message = ChatResponseMessage(role=inputs.role, content=content, tool_calls=calls)
        choices.append(
            ChatChoice(
                index=deltas[-1].index,
                message=message,
                logprobs=ChatLogprobs(content=tokens) if tokens is not None else None,
                finish_reason=reason,
            )
        )
    return _json(
        ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=generation.usage
        )
    )
