"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
streaming), ``/v1/models``, ``/health`` and Prometheus ``/metrics`` over one engine whose step
loop runs in a single worker thread.

Importing this package needs the ``server`` extra (FastAPI, uvicorn, prometheus_client).
"""

from pagedkv.server.app import BUILTIN_MODEL_NAME, create_app, default_model_name
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.runner import ServerThread

__all__ = ["BUILTIN_MODEL_NAME", "AsyncEngine", "ServerThread", "create_app", "default_model_name"]
