"""Where a model's folder comes from: a local folder, or a Hugging Face Hub id (vLLM's ``--model``).

A ``model`` that names an existing path is that folder. One that does not, and reads like a Hub
id (``org/name``), is resolved through ``huggingface_hub.snapshot_download``: from its cache
when the revision is there (so ``HF_HUB_OFFLINE=1`` runs from a populated cache), else
downloaded into it. ``download_dir`` is the cache (vLLM's ``--download-dir``; default
``HF_HUB_CACHE``), ``revision`` a branch, tag or commit (vLLM's ``--revision``; default
``main``). Anything else is left to the caller, whose "no config.json in ..." names the path.

Only the files pagedkv reads are fetched: the configs and tokenizer files first, then the
weights -- the shards ``model.safetensors.index.json`` lists when there is one (repositories that
also carry a ``consolidated.safetensors`` copy do not cost twice), else the top folder's
``*.safetensors``; none with ``weights=False`` (``load_format="dummy"``). Every failure -- no
network and not cached, no such repository or revision, a gated one -- is one
``FileNotFoundError`` naming the id, the revision, the cache and whether HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagedkv.models.builtin import builtin_model_path
from pagedkv.models.loader import INDEX_FILE

#: What a Hub repository id looks like: ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")

#: The files pagedkv reads from a model repository besides its weights.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ModelSource:
    """A model's folder, and the Hub id it was resolved from (None: a local folder)."""

    folder: Path
    repo_id: str | None = None


def is_hub_id(model: str) -> bool:
    """Whether ``model`` reads like a Hub repository id (``org/name``) rather than a path."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and "--" not in model


def resolve_model(
    model: str | Path | None,
    revision: str | None = None,
    download_dir: str | Path | None = None,
    weights: bool = True,
) -> ModelSource:
    """The folder ``model`` names (None: the built-in model); see the module docstring."""
    if model is None:
        return ModelSource(builtin_model_path())
    if isinstance(model, Path) or os.path.exists(model) or not is_hub_id(model):
        return ModelSource(Path(model))
    return ModelSource(_snapshot(model, revision, download_dir, weights), model)


def _offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE) or now


def _snapshot(repo_id: str, revision: str | None, download_dir: str | Path | None, weights: bool) -> Path:
    from huggingface_hub import constants, snapshot_download

    offline = _offline()
    cache = Path(download_dir or constants.HF_HUB_CACHE).expanduser()

    def fetch(allow_patterns: list[str], at: str | None, ignore_patterns: list[str] | None = None) -> Path:
        try:
            return Path(
                snapshot_download(
                    repo_id,
                    revision=at,
                    cache_dir=str(cache),
                    allow_patterns=allow_patterns,
                    ignore_patterns=ignore_patterns,
                    local_files_only=offline,
                )
            )
        except (OSError, ValueError) as err:
            raise FileNotFoundError(_failure(repo_id, revision, cache, offline, err)) from None

    folder = fetch(list(METADATA_FILES), revision)
    if weights:  # the weights of the very commit just fetched (its folder's name), even if a branch moved
        index = folder / INDEX_FILE
        if index.is_file():
            with open(index, encoding="utf-8") as f:
                shards = sorted(set((json.load(f).get("weight_map") or {}).values()))
            folder = fetch(shards or ["*.safetensors"], folder.name)
        else:
            folder = fetch(["*.safetensors"], folder.name, ignore_patterns=["*/*"])
    return folder


def _failure(repo_id: str, revision: str | None, cache: Path, offline: bool, err: Exception) -> str:
    """One message: what was asked for, from where, and why it could not be had."""
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    asked = f"the model {repo_id!r} (revision {revision or 'main'!r}) from the Hugging Face Hub"
    state = "HF_HUB_OFFLINE=1" if offline else "HF_HUB_OFFLINE is not set"
    if isinstance(err, GatedRepoError):
        reason = "the repository is gated: accept its terms on huggingface.co and log in (hf auth login)"
    elif isinstance(err, RepositoryNotFoundError):
        reason = "no such repository (or it is private: log in with hf auth login or set HF_TOKEN)"
    elif isinstance(err, RevisionNotFoundError):
        reason = f"the repository has no revision {revision!r}"
    elif isinstance(err, LocalEntryNotFoundError) and offline:
        reason = "the cache holds no snapshot of this revision, and downloads are off"
    elif isinstance(err, LocalEntryNotFoundError):
        reason = "the Hub could not be reached and the cache holds no snapshot of this revision"
    else:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"cannot load {asked}: {reason} ({state}; cache {cache}); it is not a local folder either"
