"""Offline throughput: the same token-id workload through pagedkv and through transformers.

    .venv/bin/python benchmarks/throughput.py [--model DIR] [--prompts 32] [--prompt-len 128]
        [--max-tokens 128] [--skip-continuous]

Baselines, run in the same process on the same prompts (greedy, ignore EOS, fp32, CPU):
transformers static-batch ``generate`` (one padded batch, its default KV cache) and transformers
continuous batching (``generate_batch``, its own paged cache). Prints generated tokens/s for
each, the ratios, and whether the generated tokens agree with pagedkv's.

``--mixed`` draws each request's prompt and output length uniformly from [16, 2 * prompt-len]
and [16, 2 * max-tokens], as real traffic does. A static batch must left-pad every prompt to
the longest and decode every row until the longest output is done; its useful tokens are each
request's own ``max_tokens`` (the rest is cut off). transformers' ``generate_batch`` takes one
``max_new_tokens`` for all requests, so it is left out of this mode.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence

import torch

from pagedkv import LLM, SamplingParams


def workload(
    num_prompts: int, prompt_len: int, max_tokens: int, vocab: int, seed: int, mixed: bool
) -> tuple[list[list[int]], list[int]]:
    """Prompts (token ids) and each one's output length."""
    rng = random.Random(seed)
    if mixed:
        lengths = [
            (rng.randint(16, 2 * prompt_len), rng.randint(16, 2 * max_tokens)) for _ in range(num_prompts)
        ]
    else:
        lengths = [(prompt_len, max_tokens)] * num_prompts
    prompts = [[rng.randrange(4, vocab) for _ in range(p)] for p, _ in lengths]
    return prompts, [o for _, o in lengths]


def run_pagedkv(path: str, prompts, max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    blocks = sum(-(-(len(p) + m) // 16) for p, m in zip(prompts, max_tokens, strict=True))
    llm = LLM(path, num_kv_blocks=blocks + 16)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outs]


def _hf_model(path: str, **kwargs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_hf_static(path: str, prompts, max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    """One left-padded batch decoded to the longest output; each row cut to its own length."""
    model = _hf_model(path)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(ids[:2, -8:], max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens), do_sample=False)
        elapsed = time.perf_counter() - start
    return elapsed, [row[width : width + m] for row, m in zip(out.tolist(), max_tokens, strict=True)]


def run_hf_continuous(path: str, prompts, max_tokens: list[int]) -> tuple[float, list[list[int]]]:
    import transformers

    model = _hf_model(path, attn_implementation="paged|sdpa")
    config = transformers.GenerationConfig(
        max_new_tokens=max_tokens[0], do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        start = time.perf_counter()
        results = model.generate_batch(prompts, generation_config=config, progress_bar=True)
        elapsed = time.perf_counter() - start
    ordered = sorted(results.values(), key=lambda r: int(str(r.request_id).split("_")[-1]))
    return elapsed, [list(r.generated_tokens) for r in ordered]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the built-in tiny Llama)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-continuous", action="store_true")
    parser.add_argument("--mixed", action="store_true", help="per-request prompt and output lengths")
    args = parser.parse_args(argv)

    from pagedkv.models import ModelConfig, builtin_model_path

    path = str(args.model or builtin_model_path())
    vocab = ModelConfig.from_pretrained(path).vocab_size
    prompts, max_tokens = workload(
        args.prompts, args.prompt_len, args.max_tokens, vocab, args.seed, args.mixed
    )
    generated = sum(max_tokens)
    shape = "mixed lengths" if args.mixed else f"{args.prompt_len} tokens, {args.max_tokens} new tokens each"
    print(
        f"workload: {args.prompts} prompts, {shape}, {generated} tokens to generate, greedy, fp32, "
        f"{torch.get_num_threads()} threads"
    )

    results = {}
    results["pagedkv"] = run_pagedkv(path, prompts, max_tokens)
    results["transformers generate (static batch)"] = run_hf_static(path, prompts, max_tokens)
    if not (args.skip_continuous or args.mixed):
        results["transformers generate_batch (continuous)"] = run_hf_continuous(path, prompts, max_tokens)

    ours_s, ours_tokens = results["pagedkv"]
    print(f"\n{'engine':45s} {'seconds':>8s} {'tok/s':>9s} {'pagedkv x':>10s} {'same tokens':>12s}")
    for name, (seconds, tokens) in results.items():
        same = sum(a == b for a, b in zip(tokens, ours_tokens, strict=True))
        print(
            f"{name:45s} {seconds:8.2f} {generated / seconds:9.1f} {seconds / ours_s:10.2f} "
            f"{same:>5d}/{len(tokens):<6d}"
        )
