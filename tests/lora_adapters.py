"""PEFT LoRA adapters for tests, made with peft itself (a test-only dependency) on a checkpoint
folder, and PEFT's greedy tokens as the reference.

PEFT starts ``lora_B`` at zero (an adapter that changes nothing); these are seeded non-zero in
both matrices, large enough that an adapter changes the greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    folder: Path,
    base: Path,
    seed: int,
    rank: int = 4,
    alpha: float = 8.0,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
) -> Path:
    """A PEFT adapter folder for the checkpoint ``base``, written by ``save_pretrained``."""
    _peft_model(folder, base, seed, rank, alpha, targets, use_rslora)
    return Path(folder)


def _peft_model(
    folder: Path, base: Path, seed: int, rank: int, alpha: float, targets: tuple[str, ...], use_rslora: bool
):
    """The PEFT model whose adapter ``make_adapter`` saves into ``folder``."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=use_rslora
    )
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return model


def adapter_and_references(
    folder: Path, base: Path, seed: int, prompts: list[list[int]], max_new: int, **options
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """``make_adapter``'s folder, with PEFT's greedy tokens with the adapter and without it, from
    the one PEFT model that saved it (one load of the base model: the real model's is slow)."""
    settings = {"rank": 4, "alpha": 8.0, "targets": ALL_TARGETS, "use_rslora": False} | options
    model = _peft_model(folder, base, seed, **settings)
    adapted = _greedy(model, prompts, max_new)
    with model.disable_adapter():
        plain = _greedy(model, prompts, max_new)
    return Path(folder), adapted, plain


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """PEFT's greedy continuations of ``prompts`` (transformers' alone for no adapter)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return _greedy(model, prompts, max_new)


def _greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import torch

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                input_ids=ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs
