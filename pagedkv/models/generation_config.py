"""A model's own sampling defaults: the sampling fields of its generation_config.json.

This is vLLM's ``--generation-config``: "auto" (the default) reads the model folder's
generation_config.json, "vllm" ignores it (``SamplingParams``' own defaults), and a folder reads
the generation_config.json there. Only vLLM's fields count -- ``repetition_penalty``,
``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``max_new_tokens``, which is ``max_tokens``
under its Hugging Face name -- and only those the file sets (null is unset). ``do_sample`` is
not read, as in vLLM: a file with ``"do_sample": false`` and no ``temperature`` leaves requests
sampling at 1.0. The defaults apply where a request leaves a field unset: ``LLM.generate``
without sampling parameters, and on the server field by field (a request's own value wins).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.tokenizer.tokenizer import read_generation_config

#: The values of ``generation_config`` that name no folder.
GENERATION_CONFIG_MODES = ("auto", "vllm")

#: The generation_config.json fields that are sampling defaults (vLLM reads these, no others).
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_config_folder(model_folder: str | Path, generation_config: str = "auto") -> Path | None:
    """The folder whose generation_config.json gives the defaults; None for "vllm". A folder
    given by name must hold that file: a mistyped path would otherwise silently change how every
    request samples."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        return Path(model_folder)
    folder = Path(generation_config)
    if not (folder / "generation_config.json").is_file():
        raise FileNotFoundError(
            f"generation_config {generation_config!r} is neither 'auto', 'vllm' nor a folder holding "
            "generation_config.json"
        )
    return folder


def default_sampling_params(model_folder: str | Path, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling defaults the model sets, as ``SamplingParams`` keyword arguments ({}: none)."""
    folder = generation_config_folder(model_folder, generation_config)
    if folder is None:
        return {}
    raw = read_generation_config(folder)
    defaults = {name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults
