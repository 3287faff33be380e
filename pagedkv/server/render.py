"""``POST /v1/completions/render`` and ``/v1/chat/completions/render``: a request's prompt token ids.

vLLM serves these so that a router can tokenize a request exactly as the worker will, without
loading the tokenizer or chat template itself: ``vllm-router --policy kv_aware`` calls them on
a worker before it routes, then looks the ids up in the prefix trees it rebuilt from the
workers' KV cache events (:mod:`pagedkv.server.kv_events`). The answer has vLLM's shape: the
completions route returns one ``{"request_id", "token_ids", "model"}`` per prompt, the chat route
one such object. Nothing is generated and nothing is queued, but the request goes through the
generation routes' own checks (:mod:`pagedkv.server.preprocess`): what they would refuse, these
refuse with the same status and message.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI

from pagedkv.server.chat_protocol import ChatCompletionRequest
from pagedkv.server.openapi import error_responses
from pagedkv.server.preprocess import ServingContext, preprocess_chat, preprocess_completion
from pagedkv.server.protocol import CompletionRequest


def _rendered(ctx: ServingContext, token_ids: list[int]) -> dict:
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": token_ids, "model": ctx.model_name}


def install_render_routes(app: FastAPI, ctx: ServingContext) -> None:
    """Add the two render routes to ``app``."""

    @app.post("/v1/completions/render", responses=error_responses(400, 401, 413))
    async def render_completion(body: CompletionRequest) -> list[dict]:
        inputs = await preprocess_completion(ctx, body)
        return [_rendered(ctx, ids) for ids in inputs.prompts]

    @app.post("/v1/chat/completions/render", responses=error_responses(400, 401, 413))
    async def render_chat(body: ChatCompletionRequest) -> dict:
        inputs = await preprocess_chat(ctx, body)
        return _rendered(ctx, inputs.prompt)
