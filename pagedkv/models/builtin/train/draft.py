"""``python -m pagedkv.models.builtin.train.draft --out DIR``: train the built-in model's draft model.

A draft model proposes tokens for speculative decoding; the target model verifies them. It must
share the target's tokenizer, and it is only worth running if it is much cheaper than the
target. This one is the built-in model's recipe (:class:`~pagedkv.models.builtin.train.recipe.Recipe`:
same text, same tokenizer training, same schedule, steps and seed) at a smaller shape: half the
width and half the depth, one KV head. BPE training on fixed text is deterministic, so the
folder's tokenizer is the built-in model's; :func:`train_draft` checks it byte for byte against
the built-in folder and refuses the result otherwise.

The shipped draft was made with
``--out pagedkv/models/builtin/checkpoints/stdlib-llama-draft --threads 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pagedkv.models.builtin import CHECKPOINTS_DIR, builtin_model_path
from pagedkv.models.builtin.train.recipe import Recipe, parse_training_args, train

#: The draft's name among the shipped models, and where it ships.
DRAFT_MODEL = "stdlib-llama-draft"
DRAFT_MODEL_DIR = CHECKPOINTS_DIR / DRAFT_MODEL

#: The built-in model's recipe at a quarter of its layer parameters: hidden 64 (from 128), two
#: layers (from four), two query heads sharing one KV head, an MLP 2.5x the width as before.
DRAFT_RECIPE = dataclasses.replace(
    Recipe(),
    hidden_size=64,
    intermediate_size=160,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
)


def train_draft(out: str | Path, recipe: Recipe = DRAFT_RECIPE, progress: bool = True) -> dict[str, Any]:
    """Train ``recipe`` into ``out`` and check that its tokenizer is the built-in model's."""
    manifest = train(recipe, out, progress=progress)
    ours = (Path(out) / "tokenizer.json").read_bytes()
    if ours != (builtin_model_path() / "tokenizer.json").read_bytes():
        raise RuntimeError(
            f"the draft's tokenizer in {out} differs from the built-in model's: the training text "
            "is not the one the built-in model saw (another Python version?)"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.models.builtin.train.draft", description=__doc__)
    args = parse_training_args(parser, argv)
    train_draft(args.out, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
