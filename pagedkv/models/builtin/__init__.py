"""The models shipped inside the package, and the recipes that make pagedkv's own models.

A shipped model is an ordinary Hugging Face folder, ``checkpoints/<name>/`` beside this module
(package data), loaded like any other checkpoint; :data:`SHIPPED_MODELS` names them and
:func:`shipped_model_path` finds one. :data:`BUILTIN_MODEL` is the one ``LLM()`` and the CLI run
when no model is given: a 4-layer Llama trained on the Python standard library's source by
:mod:`pagedkv.models.builtin.train` (``python -m pagedkv.models.builtin.train --out DIR``). It
ships trained rather than being trained at install because training is not bit-reproducible
across CPUs and BLAS builds: every install would otherwise run a slightly different model.

Beside it: :mod:`.random_model` writes seeded random-weight checkpoints (and the tokenizer
trained on :mod:`.corpus`) for tests and benchmarks that need a model of a given shape rather
than a trained one; :mod:`.hf_folder` writes such folders atomically into a cache.
"""

from __future__ import annotations

from pathlib import Path

#: The folder holding one Hugging Face folder per shipped model.
CHECKPOINTS_DIR = Path(__file__).resolve().parent / "checkpoints"

#: Every shipped model (its folder name under :data:`CHECKPOINTS_DIR`) and what to tell users
#: whenever it runs.
SHIPPED_MODELS: dict[str, str] = {
    "stdlib-llama": (
        "built-in tiny Llama (4 layers, hidden 128, ~1M parameters) trained for minutes on the Python "
        "standard library: it writes Python-looking code, not answers; pass --model PATH for a real "
        "Hugging Face checkpoint"
    ),
    "stdlib-llama-draft": (
        "the built-in model's draft model for speculative decoding (2 layers, hidden 64, ~0.2M "
        "parameters, the same tokenizer; made by python -m pagedkv.models.builtin.train.draft)"
    ),
}

#: The model run when none is given.
BUILTIN_MODEL = "stdlib-llama"

#: What to tell users whenever the built-in model is in use.
BUILTIN_NOTE = SHIPPED_MODELS[BUILTIN_MODEL]


def shipped_model_path(name: str) -> Path:
    """The folder of the shipped model ``name`` (a key of :data:`SHIPPED_MODELS`)."""
    if name not in SHIPPED_MODELS:
        raise ValueError(f"no shipped model named {name!r}; the package ships {sorted(SHIPPED_MODELS)}")
    folder = CHECKPOINTS_DIR / name
    if not (folder / "model.safetensors").is_file():
        retrain = f", or retrain it: python -m pagedkv.models.builtin.train --out {folder}"
        raise FileNotFoundError(
            f"the shipped model {name!r} is missing from {folder}; reinstall pagedkv"
            + (retrain if name == BUILTIN_MODEL else "")
        )
    return folder


def builtin_model_path() -> Path:
    """The folder of :data:`BUILTIN_MODEL`."""
    return shipped_model_path(BUILTIN_MODEL)
