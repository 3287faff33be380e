"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
streaming), ``/v1/models``, ``/health`` and Prometheus ``/metrics`` over one engine whose step
loop runs in a single worker thread.

Names are imported on first use, so ``pagedkv.server.cli`` (imported by ``pagedkv --help``)
loads neither FastAPI nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.server.app import BUILTIN_MODEL_NAME, create_app, default_model_name  # noqa: F401
    from pagedkv.server.async_engine import AsyncEngine  # noqa: F401
    from pagedkv.server.runner import ServerThread  # noqa: F401

_EXPORTS = {
    "BUILTIN_MODEL_NAME": "pagedkv.server.app",
    "create_app": "pagedkv.server.app",
    "default_model_name": "pagedkv.server.app",
    "AsyncEngine": "pagedkv.server.async_engine",
    "ServerThread": "pagedkv.server.runner",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedkv.server' has no attribute {name!r}")
