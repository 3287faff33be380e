"""Train the built-in model: BPE, then a tiny Llama, on the standard library's source, on CPU.

The network is ``transformers``' own ``LlamaForCausalLM`` (pagedkv's model is built for paged
inference, not for gradients), so the folder it writes is by construction what transformers
reads, and pagedkv's loader reading it is the same test every real checkpoint passes. Every
random choice is seeded: the initial weights, the order of the training windows. On one machine
with one thread count a run repeats exactly; across CPUs and BLAS builds float rounding
differs, which is why the trained folder ships in the package rather than being rebuilt at
install.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedkv.models.builtin.hf_folder import write_json
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.models.builtin.train.windows import (
    document_windows,
    encode_documents,
    perplexity,
    scored_tokens,
)
from pagedkv.tokenizer.bpe import BOS_ID, EOS_TOKEN_IDS, train_bpe, write_tokenizer_files

#: The manifest written beside the weights: recipe, text, results.
MANIFEST = "training.json"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights (besides the machine's float rounding)."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 320
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    #: tokens per training window, and per perplexity window
    context: int = 256
    #: positions the config declares (RoPE extends past ``context``; quality falls there)
    max_position_embeddings: int = 4096
    batch_size: int = 16
    steps: int = 600
    learning_rate: float = 4e-3
    warmup_steps: int = 40
    #: the cosine schedule ends at this fraction of ``learning_rate``
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    #: dtype the weights are stored in (the loader casts to whatever dtype is asked for)
    storage_dtype: str = "bfloat16"
    #: caps for quick runs (tests): whole files in sorted order, up to this many characters
    max_train_chars: int | None = None
    max_heldout_chars: int | None = None
    eval_batch_size: int = 32


def llama_config(recipe: Recipe) -> Any:
    """The transformers ``LlamaConfig`` of ``recipe`` (tied embeddings, GQA, no biases)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_TOKEN_IDS,
        pad_token_id=None,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def packed_windows(documents: list[list[int]], context: int) -> torch.Tensor:
    """All documents end to end, cut into ``[n, context]`` training windows (the tail that does
    not fill a window is dropped). Packing across documents wastes no token; EOS then BOS marks
    each boundary."""
    stream = torch.tensor([i for ids in documents for i in ids], dtype=torch.long)
    n = len(stream) // context
    if n == 0:
        raise ValueError(f"the training text has {len(stream)} tokens, fewer than one window of {context}")
    return stream[: n * context].view(n, context)


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine decay to ``final_lr_fraction`` of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    floor = recipe.final_lr_fraction
    return recipe.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=(0.9, 0.95))


def fit(model: torch.nn.Module, windows: torch.Tensor, recipe: Recipe, progress: bool = True) -> list[float]:
    """Train ``model`` for ``recipe.steps`` batches of shuffled windows; the loss of each step."""
    gen = torch.Generator().manual_seed(recipe.seed)
    order = torch.randperm(len(windows), generator=gen)
    optimizer = _optimizer(model, recipe)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(recipe.steps), desc="training", unit="step", disable=not progress)
    cursor = 0
    for step in bar:
        if cursor + recipe.batch_size > len(order):  # next epoch, new order
            order, cursor = torch.randperm(len(windows), generator=gen), 0
        batch = windows[order[cursor : cursor + recipe.batch_size]]
        cursor += recipe.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        recent = losses[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", lr=f"{learning_rate(recipe, step):.1e}")
    model.eval()
    return losses


@torch.no_grad()
def total_nll(model: torch.nn.Module, windows: list[list[int]], batch_size: int) -> float:
    """Summed negative log-likelihood (nats) of every window's tokens after its first.

    Windows are right-padded to a common length; in a causal model a real token never attends
    to the padding after it, and padded targets are masked out of the sum.
    """
    total = 0.0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        width = max(len(w) for w in chunk)
        ids = torch.full((len(chunk), width), BOS_ID, dtype=torch.long)
        mask = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
        for row, window in enumerate(chunk):
            ids[row, : len(window)] = torch.tensor(window)
            mask[row, : len(window) - 1] = True
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        total += nll[mask].sum().item()
    return total


def evenly_spaced(windows: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Every k-th window, k chosen so the picked windows score about ``num_tokens`` tokens."""
    step = max(1, round(scored_tokens(windows) / max(num_tokens, 1)))
    return windows[::step]


def train(recipe: Recipe, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """Train on the local standard library, write the Hugging Face folder ``out`` (created if
    needed) with its ``training.json``, and return that manifest."""
    import transformers

    started = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train_files, heldout_files = stdlib_text.split_files()
    train_texts = stdlib_text.read_sources(train_files, max_chars=recipe.max_train_chars)
    heldout_texts = stdlib_text.read_sources(heldout_files, max_chars=recipe.max_heldout_chars)
    train_files, heldout_files = train_files[: len(train_texts)], heldout_files[: len(heldout_texts)]

    tokenizer = train_bpe(train_texts, recipe.vocab_size)
    train_docs = encode_documents(tokenizer, train_texts)
    heldout_docs = encode_documents(tokenizer, heldout_texts)
    windows = packed_windows(train_docs, recipe.context)

    torch.manual_seed(recipe.seed)
    model = transformers.LlamaForCausalLM(llama_config(recipe))
    train_started = time.perf_counter()
    losses = fit(model, windows, recipe, progress)
    train_seconds = time.perf_counter() - train_started

    model.to(getattr(torch, recipe.storage_dtype))
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_TOKEN_IDS)
    model.save_pretrained(out)
    write_tokenizer_files(out, tokenizer, recipe.max_position_embeddings)

    # Perplexities of the folder as shipped (weights rounded to storage_dtype), run in float32.
    stored = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    heldout_windows = document_windows(heldout_docs, recipe.context)
    heldout_tokens = scored_tokens(heldout_windows)
    train_sample = evenly_spaced(document_windows(train_docs, recipe.context), heldout_tokens)
    results = {
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_perplexity": perplexity(
            total_nll(stored, heldout_windows, recipe.eval_batch_size), heldout_tokens
        ),
        "train_perplexity": perplexity(
            total_nll(stored, train_sample, recipe.eval_batch_size), scored_tokens(train_sample)
        ),
        "heldout_scored_tokens": heldout_tokens,
        "train_sample_scored_tokens": scored_tokens(train_sample),
        "training_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    manifest = {
        "recipe": dataclasses.asdict(recipe),
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
        },
        "text": {
            "source": f"the *.py files of the Python standard library ({stdlib_text.__name__})",
            "train_files": len(train_files),
            "train_chars": sum(map(len, train_texts)),
            "train_tokens": sum(map(len, train_docs)),
            "train_fingerprint": stdlib_text.fingerprint(train_files, train_texts),
            "heldout_files": heldout_files,
            "heldout_chars": sum(map(len, heldout_texts)),
            "heldout_tokens": sum(map(len, heldout_docs)),
            "heldout_fingerprint": stdlib_text.fingerprint(heldout_files, heldout_texts),
        },
        "results": results,
        "loss_every_10_steps": [round(x, 4) for x in losses[::10]],
    }
    write_json(out / MANIFEST, manifest)
    if progress:
        print(json.dumps(results, indent=2), file=sys.stderr)
    return manifest


def parse_training_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` with the options every training command takes added to ``parser``: where to
    write (``--out``), torch's threads (``--threads``, set here) and ``--no-progress``."""
    parser.add_argument("--out", required=True, help="folder to write the Hugging Face checkpoint into")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or summary")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return args
