"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions`` (with SSE
streaming), ``/v1/models``, ``/health`` and Prometheus ``/metrics`` over one engine whose step
loop runs in a single worker thread.

Names are imported on first use, so ``pagedkv.server.cli`` (imported by ``pagedkv --help``)
loads neither FastAPI nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from pagedkv.server.app import BUILTIN_MODEL_NAME, create_app, default_model_name  # noqa: F401
    from pagedkv.server.async_engine import AsyncEngine  # noqa: F401
    from pagedkv.server.runner import ServerThread  # noqa: F401

EXPORTS = {
    "BUILTIN_MODEL_NAME": "pagedkv.server.app",
    "create_app": "pagedkv.server.app",
    "default_model_name": "pagedkv.server.app",
    "AsyncEngine": "pagedkv.server.async_engine",
    "ServerThread": "pagedkv.server.runner",
}
__all__ = list(EXPORTS)
__getattr__ = lazy_exports(__name__, EXPORTS)
