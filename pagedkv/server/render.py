"""``POST /v1/completions/render`` and ``/v1/chat/completions/render``: a request's prompt token ids.

vLLM serves these so that a router can tokenize a request exactly as the worker will, without
loading the tokenizer or chat template itself: ``vllm-router --policy kv_aware`` calls them on
a worker before it routes, then looks the ids up in the prefix trees it rebuilt from the
workers' KV cache events (:mod:`pagedkv.server.kv_events`). The answer has vLLM's shape: the
completions route returns one ``{"request_id", "token_ids", "model"}`` per prompt, the chat route
one such object. Nothing is generated and nothing is queued.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI

from pagedkv.engine import InvalidRequestError
from pagedkv.server.errors import APIError
from pagedkv.server.openapi import error_responses
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.server.serving import ServingContext, chat_prompt


def _rendered(ctx: ServingContext, token_ids: list[int]) -> dict:
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": token_ids, "model": ctx.model_name}


def install_render_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Add the two render routes to ``app`` (they share the generation routes' validation)."""

    @app.post("/v1/completions/render", responses=error_responses(400, 401, 413))
    async def render_completion(body: CompletionRequest) -> list[dict]:
        ctx.check_model(body.model)
        texts = body.prompts()
        ctx.check_size(len(texts), body.sampling_params())
        body.check_text()
        try:
            return [_rendered(ctx, ctx.encoder.encode(text)) for text in texts]
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None

    @app.post("/v1/chat/completions/render", responses=error_responses(400, 401, 413))
    async def render_chat(body: ChatCompletionRequest) -> dict:
        ctx.check_model(body.model)
        return _rendered(ctx, chat_prompt(ctx, body))
