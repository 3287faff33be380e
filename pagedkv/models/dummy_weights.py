"""Seeded random weights made on the device from a config alone: vLLM's ``load_format="dummy"``.

A benchmark of a model's *shape* (Llama-3.1-8B's, say) needs neither a download nor a
checkpoint on disk: every tensor a checkpoint of that config would hold is drawn here, on the
model's device, from a generator seeded by the tensor's checkpoint name. The same name gives
the same tensor in any order and in any model that names its weights as transformers does:
pagedkv's packed projections fill their row slices by those names
(:func:`pagedkv.models.loader.checkpoint_targets`), a transformers model its own parameters, so
the two hold the same weights. Matrices are N(0, :data:`STD`) (transformers'
``initializer_range``), norm weights ones and biases zeros, as a freshly initialised model.
"""

from __future__ import annotations

import zlib

import torch

#: the standard deviation of every matrix (transformers' default ``initializer_range``)
STD = 0.02
#: the seed every name's generator starts from
SEED = 0


def dummy_tensor(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, seed: int = SEED
) -> torch.Tensor:
    """The tensor called ``name`` (a checkpoint name) of a dummy checkpoint."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    return values.mul_(STD).to(dtype)


@torch.no_grad()
def fill_dummy_weights(targets: dict[str, torch.Tensor], seed: int = SEED) -> None:
    """Fill every ``name -> tensor`` target with :func:`dummy_tensor` of its name, in place."""
    for name, target in targets.items():
        target.copy_(dummy_tensor(name, tuple(target.shape), target.dtype, target.device, seed))
