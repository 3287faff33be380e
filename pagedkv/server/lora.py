"""LoRA adapters over HTTP, as vLLM serves them: a request's ``model`` names an adapter,
``/v1/models`` lists the adapters beside the base model (``parent``: the base model's name), and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` add and remove adapters while the
server runs.

``--lora-modules name=path ...`` are checked and added when the server starts (a bad one stops
the start). vLLM installs the load and unload routes only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``
is set and reads any path the server can; pagedkv installs them only with ``--lora-dir``, and
loads only folders under one of those roots (symbolic links resolved first), so a client holding
the API key still cannot make the server read an arbitrary file. Both routes sit behind the API
key like every ``/v1`` route. Each adapter loaded gets a new id, so a name unloaded and loaded
again from another folder never shares the old one's cached KV blocks.

The name table is the event loop's; the engine's own registry is changed on its worker thread
(:meth:`~pagedkv.server.async_engine.AsyncEngine.call`), which also checks the folder.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from pagedkv.engine import InvalidRequestError, LLMEngine, LoRARequest
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.errors import APIError


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/load_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's body of ``/v1/unload_lora_adapter`` (``lora_int_id`` is accepted and ignored)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON ``{"name": ..., "path": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            entry = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--lora-modules entry is not valid JSON: {err}") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry.get("path"):
            raise ValueError(f'--lora-modules JSON needs "name" and "path", got {text!r}')
        return entry["name"], str(entry["path"])
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules takes name=path, got {text!r}")
    return name, path


class ServedAdapters:
    """The adapters clients may name, by name (see the module docstring)."""

    def __init__(self, roots: Sequence[str | Path] = ()) -> None:
        self.roots = [Path(root).resolve() for root in roots]
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def add_at_start(self, engine: LLMEngine, name: str, path: str) -> None:
        """A ``--lora-modules`` adapter, checked by ``engine`` (not serving yet) at once."""
        lora = self._new(name, path)
        engine.add_lora(lora)
        self._by_name[name] = lora

    def _new(self, name: str, path: str) -> LoRARequest:
        if name in self._by_name:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        return LoRARequest(name, next(self._ids), path)

    def check_root(self, path: str) -> None:
        """Refuse a folder outside every ``--lora-dir`` root."""
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            raise APIError(
                HTTPStatus.FORBIDDEN,
                f"lora_path {path!r} is outside the folders adapters may be loaded from (--lora-dir)",
                type="permission_error",
                param="lora_path",
            )

    async def load(self, engine: AsyncEngine, name: str, path: str) -> None:
        self.check_root(path)
        try:
            lora = self._new(name, path)
            await engine.call(lambda e: e.add_lora(lora))
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None
        self._by_name[name] = lora

    async def unload(self, engine: AsyncEngine, name: str) -> None:
        lora = self._by_name.get(name)
        if lora is None:
            raise APIError(
                HTTPStatus.NOT_FOUND, f"The lora adapter '{name}' cannot be found.", type="not_found_error"
            )
        try:
            await engine.call(lambda e: e.remove_lora(lora.lora_int_id))
        except InvalidRequestError as err:
            raise APIError.from_value_error(err) from None
        del self._by_name[name]


def install_lora_routes(app: FastAPI, engine: AsyncEngine, adapters: ServedAdapters) -> None:
    """The load and unload routes (only with ``--lora-dir`` roots to load from)."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> str:
        await adapters.load(engine, body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> str:
        await adapters.unload(engine, body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
