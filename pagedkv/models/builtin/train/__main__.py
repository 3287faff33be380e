"""``python -m pagedkv.models.builtin.train --out DIR``: train the built-in model into ``DIR``.

The shipped model was made with ``--out pagedkv/models/builtin/checkpoints/stdlib-llama`` and
the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from pagedkv.models.builtin.train.recipe import Recipe, train


def main(argv: list[str] | None = None) -> int:
    defaults = Recipe()
    parser = argparse.ArgumentParser(prog="python -m pagedkv.models.builtin.train", description=__doc__)
    parser.add_argument("--out", required=True, help="folder to write the Hugging Face checkpoint into")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or summary")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    recipe = dataclasses.replace(defaults, steps=args.steps, seed=args.seed)
    train(recipe, args.out, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
