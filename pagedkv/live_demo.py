"""The live half of ``pagedkv demo``: a batch through the real engine, with its KV figures.

After every step the engine's statistics record (``LLMEngine.last_step``) gives the blocks the
paged cache really holds; next to them, the blocks a contiguous allocator would have reserved
for the same running requests (each one's whole ``max_model_len`` up front, as the systems
before PagedAttention did). The prompts are pieces of the standard library's held-out source
files (never trained on), so the built-in model continues real Python.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.memory import blocks_for
from pagedkv.models import BUILTIN_NOTE
from pagedkv.models.builtin.train import stdlib_text
from pagedkv.tokenizer import Tokenizer


@dataclass
class LiveKVFigures:
    steps: int
    peak_running: int
    peak_blocks_used: int
    peak_blocks_contiguous: int
    mean_token_utilization: float
    generated_tokens: int
    preemptions: int
    #: Computed tokens preemption threw away, and every token the forward passes computed.
    dropped_tokens: int
    computed_tokens: int
    blocks_used_after: int
    total_blocks: int
    block_size: int
    sample_text: str

    @property
    def saving(self) -> float:
        return self.peak_blocks_contiguous / max(self.peak_blocks_used, 1)


def heldout_prompts(tokenizer: Tokenizer, num: int, rng: random.Random) -> list[list[int]]:
    """``num`` prompts of 8-120 tokens, each cut at a random place from a held-out source file."""
    _, heldout = stdlib_text.split_files()
    documents = [
        tokenizer.encode(text, add_special_tokens=False) for text in stdlib_text.read_sources(heldout[:8])
    ]
    prompts = []
    for _ in range(num):
        ids = rng.choice(documents)
        length = rng.randint(8, 120)
        start = rng.randrange(0, max(1, len(ids) - length))
        prompts.append(ids[start : start + length])
    return prompts


def run_live_batch(
    num_requests: int = 24, max_model_len: int = 1024, seed: int = 0, model: str | None = None
) -> LiveKVFigures:
    """Run ``num_requests`` prompts of mixed lengths through the engine and measure its KV use."""
    engine = LLMEngine(EngineConfig(model=model, max_model_len=max_model_len, num_kv_blocks=1024))
    rng = random.Random(seed)
    for i, prompt in enumerate(heldout_prompts(engine.tokenizer, num_requests, rng)):
        params = SamplingParams(
            max_tokens=rng.randint(8, 64), temperature=0.8, seed=seed + i, ignore_eos=True
        )
        engine.add_request(f"demo-{i}", prompt, params)
    per_request = blocks_for(max_model_len, engine.settings.cache.block_size)
    steps = peak_running = peak_used = peak_contiguous = computed = 0
    utilizations = []
    sample_text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and len(out.outputs[0].text) > len(sample_text):
                sample_text = out.outputs[0].text
        step = engine.last_step
        steps += 1
        computed += step.num_tokens
        peak_running = max(peak_running, step.running)
        peak_used = max(peak_used, step.kv_blocks_used)
        peak_contiguous = max(peak_contiguous, step.running * per_request)
        if step.kv_blocks_used:
            utilizations.append(step.kv_utilization)
    stats = engine.stats()
    return LiveKVFigures(
        steps=steps,
        peak_running=peak_running,
        peak_blocks_used=peak_used,
        peak_blocks_contiguous=peak_contiguous,
        mean_token_utilization=sum(utilizations) / max(len(utilizations), 1),
        generated_tokens=stats.generated_tokens,
        preemptions=stats.preemptions,
        dropped_tokens=stats.dropped_tokens,
        computed_tokens=computed,
        blocks_used_after=stats.kv.used_blocks,
        total_blocks=stats.kv.total_blocks,
        block_size=stats.kv.block_size,
        sample_text=sample_text,
    )


def print_live_batch(figures: LiveKVFigures, console: Console, max_model_len: int) -> None:
    """The batch's figures, each with what it is beside it."""
    console.print(f"[bold]Live engine[/bold] -- {BUILTIN_NOTE}")
    per_request = blocks_for(max_model_len, figures.block_size)
    contiguous = f"{figures.peak_running} x {per_request} ({max_model_len} tokens each)" + (
        f": more than the pool's {figures.total_blocks}"
        if figures.peak_blocks_contiguous > figures.total_blocks
        else ""
    )
    table = Table(
        title="KV cache of a live batch: paged vs contiguous reservation",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        pad_edge=False,
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("what it is")
    rows = (
        ("engine steps", str(figures.steps), "forward passes until every request finished"),
        ("peak concurrent requests", str(figures.peak_running), "requests running in one step"),
        ("generated tokens", str(figures.generated_tokens), "8-64 per request, end of text ignored"),
        (
            "peak KV blocks held (paged)",
            str(figures.peak_blocks_used),
            f"blocks of {figures.block_size} tokens, taken as tokens came",
        ),
        ("blocks contiguous would reserve", str(figures.peak_blocks_contiguous), contiguous),
        ("contiguous / paged", f"{figures.saving:.1f}x", "KV memory paging saves at the peak"),
        (
            "slots used in held blocks (mean)",
            f"{figures.mean_token_utilization:.1%}",
            "only a sequence's last block has empty slots",
        ),
        ("preemptions", str(figures.preemptions), "requests evicted to make room"),
        (
            "tokens thrown away by preemption",
            f"{figures.dropped_tokens} of {figures.computed_tokens}",
            "work computed again after an eviction",
        ),
        (
            "blocks still held after the batch",
            str(figures.blocks_used_after),
            "0: every block back in the pool",
        ),
    )
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print("longest output (the continuation of a piece of a held-out source file):")
    console.print(figures.sample_text[:240], markup=False, highlight=False)
