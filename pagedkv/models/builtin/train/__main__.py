"""``python -m pagedkv.models.builtin.train --out DIR``: train the built-in model into ``DIR``.

The shipped model was made with ``--out pagedkv/models/builtin/checkpoints/stdlib-llama`` and
the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses

from pagedkv.models.builtin.train.recipe import Recipe, parse_training_args, train


def main(argv: list[str] | None = None) -> int:
    defaults = Recipe()
    parser = argparse.ArgumentParser(prog="python -m pagedkv.models.builtin.train", description=__doc__)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parse_training_args(parser, argv)
    recipe = dataclasses.replace(defaults, steps=args.steps, seed=args.seed)
    train(recipe, args.out, progress=not args.no_progress)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
