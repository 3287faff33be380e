"""The two generation endpoints: requests to engine prompts, deltas to OpenAI responses.

Both endpoints validate everything (model name, sampling values, prompt length, cache fit,
queue room; :mod:`pagedkv.server.preprocess`) *before* the response starts, so a refused request
gets a real HTTP status rather than a 200 stream with an error inside. Once streaming, the
response is server-sent events, one ``data: {chunk}`` per choice delta, an optional usage chunk,
then ``data: [DONE]``; with ``stream_options.continuous_usage_stats`` (and ``include_usage``)
every chunk also carries the usage so far. ``echo`` (vLLM's) puts the prompt, or for chat the
last message, before a choice's first delta. A response to a body with fields the server does
not know carries their names (:mod:`pagedkv.server.ignored_fields`).

A failure is logged once, with the request's id, which the answer carries too: a generation that
fails after admission here (:func:`_failure`), a failure the engine reports by the engine itself
(its request ids are this request's, or ``<id>-<n>`` for prompt n of a batch), a bug anywhere
else by :class:`~pagedkv.server.middleware.InternalErrorMiddleware`, which finds the id in
``request.state``.
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
from pagedkv.server.chat_protocol import ChatCompletionRequest
from pagedkv.server.errors import APIError, EngineRequestError, QueueFullError
from pagedkv.server.generation import ChoiceDelta, Generation, collect_unless_disconnected
from pagedkv.server.ignored_fields import ignored_headers
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.preprocess import ChatInputs, ServingContext, preprocess_chat, preprocess_completion
from pagedkv.server.protocol import CompletionRequest
from pagedkv.server.reasoning import ReasoningParser, reasoning_parser_class
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


def _json(body: BaseModel, headers: dict[str, str]) -> Response:
    """pydantic's JSON (a -inf logprob becomes null, where ``json.dumps`` would refuse it)."""
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


def _stream(generation: Generation, chunks: AsyncIterator[str], headers: dict[str, str]) -> Response:
    return StreamingResponse(_sse_events(generation, chunks), media_type="text/event-stream", headers=headers)


def _new_request_id(request: Request, prefix: str) -> str:
    """The request's id, also left where a failure's log and answer find it."""
    request.state.request_id = request_id = f"{prefix}-{uuid.uuid4().hex}"
    return request_id


def _sse(chunk: BaseModel | dict) -> str:
    body = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {body}\n\n"


def _shows(delta: ChoiceDelta, wants_logprobs: bool) -> bool:
    """Whether a delta is worth a chunk: tokens whose text is held back (half a UTF-8
    character, a possible stop string) carry nothing to show unless logprobs were asked for."""
    return bool(delta.text) or delta.finish_reason is not None or (wants_logprobs and bool(delta.token_ids))


def _failure(err: Exception, request_id: str) -> APIError:
    """What a generation that failed after admission answers: a plain message and the request id
    (the exception itself is in the server log, under that id: logged here, or by the engine for
    an :class:`EngineRequestError`)."""
    if isinstance(err, Aborted):
        logger.warning("request %s was aborted: %s", request_id, err)
        message = f"{err} (request id {request_id})"
        return APIError(HTTPStatus.SERVICE_UNAVAILABLE, message, type="server_error", code="aborted")
    if not isinstance(err, EngineRequestError):
        logger.error("request %s failed", request_id, exc_info=err)
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
    cache_salt: str | None,
    model: str | None,
) -> Generation:
    lora = ctx.lora_request(model)
    generation = Generation(ctx.engine, request_id, prompts, params, priority, grammar, cache_salt, lora)
    try:
        await generation.start()
    except QueueFullError as err:
        logger.warning("request %s refused: %s", request_id, err.message)
        message = f"{err.message} (request id {request_id})"
        raise APIError(err.status, message, type=err.type, code=err.code) from None
    except (Aborted, EngineRequestError) as err:
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
    request_id = _new_request_id(request, "cmpl")
    inputs = await preprocess_completion(ctx, body)
    params = inputs.params
    headers = ignored_headers(body, request_id)
    generation = await _start(
        ctx, request_id, inputs.prompts, params, body.priority, inputs.grammar, body.cache_salt, body.model
    )
    formatter = LogprobFormatter(ctx.tokenizer, bool(body.return_tokens_as_token_ids))
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
            stop_reason=delta.stop_reason,
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
                usage = generation.usage_so_far() if body.continuous_usage else None
                yield _sse(
                    CompletionResponse(
                        id=request_id,
                        created=created,
                        model=ctx.model_name,
                        choices=[choice(delta)],
                        usage=usage,
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

        return _stream(generation, chunks(), headers)

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
                stop_reason=deltas[-1].stop_reason,
                prompt_logprobs=merged[0].prompt_logprobs,
            )
        )
    return _json(
        CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices, usage=generation.usage
        ),
        headers,
    )


# -- /v1/chat/completions ----------------------------------------------------------------------
def _reasoning_parsers(
    ctx: ServingContext, inputs: ChatInputs, num_choices: int
) -> list[ReasoningParser] | None:
    """One reasoning parser per choice, with --reasoning-parser. Not for a constrained answer:
    its grammar (a response format, a forced tool call) leaves no room for thinking."""
    if ctx.reasoning_parser is None or inputs.grammar is not None:
        return None
    parser = reasoning_parser_class(ctx.reasoning_parser)
    return [parser(inputs.prompt_text) for _ in range(num_choices)]


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext
) -> Response:
    request_id = _new_request_id(request, "chatcmpl")
    inputs = await preprocess_chat(ctx, body)
    prompt, params = inputs.prompt, inputs.params
    headers = ignored_headers(body, request_id)
    generation = await _start(
        ctx, request_id, [prompt], params, body.priority, inputs.grammar, body.cache_salt, body.model
    )
    formatter = LogprobFormatter(ctx.tokenizer, bool(body.return_tokens_as_token_ids))
    wants_logprobs = params.logprobs is not None
    reasoning = _reasoning_parsers(ctx, inputs, generation.num_choices)

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
            if usage is None and body.continuous_usage:
                usage = generation.usage_so_far()
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
                thought, text = None, delta.text
                if reasoning is not None:  # the text is the content part only
                    thought, text = reasoning[delta.index].feed(text, final=delta.finish_reason is not None)
                    thought = thought or None
                if answers is None:
                    shown = bool(text) or thought is not None or delta.finish_reason is not None
                    if not (shown or (wants_logprobs and delta.token_ids)):
                        continue
                    content, calls, reason = text, None, delta.finish_reason
                    if reasoning is not None and not text:
                        content = None
                else:
                    content, calls, reason = answers[delta.index].stream(text, delta.finish_reason)
                    says_nothing = content is None and calls is None and reason is None and thought is None
                    if says_nothing and not (wants_logprobs and delta.token_ids):
                        continue
                yield chunk(
                    ChatStreamChoice(
                        index=delta.index,
                        delta=ChatDelta(content=content, reasoning_content=thought, tool_calls=calls),
                        logprobs=logprobs(delta),
                        finish_reason=reason,
                        stop_reason=delta.stop_reason if reason is not None else None,
                    )
                )
            if body.include_usage:
                yield chunk(None, usage=generation.usage)

        return _stream(generation, chunks(), headers)

    per_choice = await _respond(request, generation)
    choices = []
    for deltas in per_choice:
        tokens = [token for d in deltas for token in formatter.chat(d.logprobs)] if wants_logprobs else None
        text, reason = "".join(d.text for d in deltas), deltas[-1].finish_reason
        thought = None
        if reasoning is not None:
            thought, text = reasoning[deltas[-1].index].split(text)
            text = text or ""
        if answers is None:
            content = inputs.echo + text
            if reasoning is not None and not content:
                content = None
            message = ChatResponseMessage(role=inputs.role, content=content, reasoning_content=thought)
        else:
            content, calls, reason = answers[deltas[-1].index].complete(text, reason)
            content = inputs.echo + content if content is not None else (inputs.echo or None)
            message = ChatResponseMessage(
                role=inputs.role, content=content, reasoning_content=thought, tool_calls=calls
            )
        choices.append(
            ChatChoice(
                index=deltas[-1].index,
                message=message,
                logprobs=ChatLogprobs(content=tokens) if tokens is not None else None,
                finish_reason=reason,
                stop_reason=deltas[-1].stop_reason,
            )
        )
    prompt_logprobs = generation.prompt_logprobs.get(0)
    return _json(
        ChatCompletionResponse(
            id=request_id,
            created=created,
            model=ctx.model_name,
            choices=choices,
            usage=generation.usage,
            prompt_logprobs=formatter.prompt(prompt_logprobs) if prompt_logprobs is not None else None,
        ),
        headers,
    )
