"""Batched decode over mixed LoRA adapters against the same batch on the base model.

``--requests`` requests (prompt ``--prompt-len`` tokens, ``--max-tokens`` generated) spread
round-robin over ``--adapters`` seeded adapters of rank ``--rank`` on every target, run on an
engine with LoRA, against the same prompts on an engine without it; rounds interleaved, medians
of wall and process CPU time (on a shared machine CPU time moves less with the neighbours'
load; run with ``OMP_NUM_THREADS=1`` there: threads that wait for a busy core spin). Example
(the built-in model, float32)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/lora_ab.py --rounds 9

The adapters are PEFT-format folders written here (``adapter_config.json`` and
``adapter_model.safetensors``, ``A`` and ``B`` seeded normal), in ``--adapter-dir``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.models import ModelConfig, builtin_model_path
from pagedkv.models.lora_checkpoint import CONFIG_FILE, TARGETS, WEIGHTS_FILE, projection_shapes


def write_adapter(folder: Path, config: ModelConfig, rank: int, seed: int) -> Path:
    """A rank-``rank`` adapter of every target projection of every layer, as PEFT saves one."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for name, (n_in, n_out) in projection_shapes(config).items():
            part = "self_attn" if TARGETS[name] in ("qkv_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank**0.5
    save_file(tensors, str(folder / WEIGHTS_FILE))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / CONFIG_FILE).write_text(json.dumps(settings | {"bias": "none", "lora_dropout": 0.0}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="an HF folder (default: the built-in model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--adapter-dir", type=Path, default=Path("pagedkv-report") / "lora-adapters")
    args = parser.parse_args()
    model = args.model or builtin_model_path()
    config = ModelConfig.from_pretrained(model)
    folders = [
        write_adapter(args.adapter_dir / f"{Path(model).name}-r{args.rank}-{i}", config, args.rank, i + 1)
        for i in range(args.adapters)
    ]
    rng = random.Random(0)
    prompts = [
        [rng.randrange(4, config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    options = {"dtype": args.dtype, "enable_prefix_caching": False, "max_model_len": 2048}
    base = LLM(str(model), **options)
    lora = LLM(str(model), **options, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    adapters = [LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
    variants = {
        "base model": (base, None),
        f"{args.adapters} adapters": (lora, [adapters[i % args.adapters] for i in range(args.requests)]),
    }
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and loads the adapters)
        for name, (llm, requests) in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
            if rnd:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    tokens = args.requests * args.max_tokens
    for name in variants:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"{name:>12}: {tokens / w:8.1f} generated tok/s (median wall {w:.3f} s, CPU {c:.3f} s)")
    (first, second) = variants
    ratio_wall = statistics.median(wall[first]) / statistics.median(wall[second])
    ratio_cpu = statistics.median(cpu[first]) / statistics.median(cpu[second])
    print(f"adapters / base throughput: {ratio_wall:.3f} (wall), {ratio_cpu:.3f} (CPU time)")


if __name__ == "__main__":
    main()
