"""Seeded random LoRA adapters for ``pagedkv bench lora``, written as PEFT writes them
(``adapter_config.json`` and ``adapter_model.safetensors``), so the engine reads them through
its own checks like any user's adapter; no PEFT needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_adapter(folder: Path, model_config: Any, rank: int, seed: int) -> Path:
    """A rank-``rank`` adapter of every target of every layer of a model of ``model_config`` (its
    checkpoint's projections: Phi-3's fused ones), its ``A`` and ``B`` small seeded normals
    (``lora_alpha`` = 2 ``rank``)."""
    import torch
    from safetensors.torch import save_file

    from pagedkv.models.lora_checkpoint import TARGETS, model_targets, projection_shapes

    folder.mkdir(parents=True, exist_ok=True)
    shapes, targets = projection_shapes(model_config), model_targets(model_config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for target in targets:
            in_features, out_features = shapes[target]
            module = "self_attn" if TARGETS[target] in ("qkv_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{module}.{target}"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=gen) / in_features**0.5
            )
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) / rank**0.5 / 8
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (folder / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def slot_bytes(model_config: Any, max_rank: int, element_bytes: int) -> int:
    """Bytes one fixed adapter slot takes (``A`` and ``B`` of every target at ``max_rank``)."""
    from pagedkv.models.lora_checkpoint import model_targets, projection_shapes

    shapes = projection_shapes(model_config)
    per_layer = sum(max_rank * (shapes[t][0] + shapes[t][1]) for t in model_targets(model_config))
    return model_config.num_layers * per_layer * element_bytes
