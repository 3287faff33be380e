"""``pagedkv bench capacity --hybrid`` (alias ``capacity-hybrid``): sequences one KV budget
holds with hybrid paging on and off.

For each model shape -- Gemma 2's (half the layers windowed, 4,096 tokens) and Gemma 3's (five
layers in six windowed, 1,024 tokens), or the layer kinds and window of ``model``'s config.json
-- at 32k-token contexts, two live engines get the same KV budget in bytes: one pages by KV group
(:mod:`pagedkv.memory.kv_groups`, its blocks one group's layers deep), one keeps every block of
every layer (``disable_hybrid_kv_cache_manager``). Every request is submitted at once: a prompt
of the context less ``decode_tokens``, then ``decode_tokens`` greedy tokens, so each ends holding
a whole context. The figure is the most sequences running at once, and their ratio, next to its
bound: the layer-blocks a whole context takes without hybrid paging over those it takes with it
(at 32k and 4,096: 1.77x). A prompt is computed in chunks of ``max_num_batched_tokens``; its
sliding groups hold a window and a chunk at most, so admission approaches the bound as the
chunk shrinks against the window. The budget holds ``budget_contexts`` whole contexts of the
engine without hybrid paging.

The models are tiny (hidden 64) with seeded random weights (``load_format="dummy"``), a
``model``'s sizes shrunk to those: what is measured is the scheduler's admission against the
pool, which depends on the layer kinds and the lengths only. ``scale`` divides the context, the
windows, the decode length and the chunk (not the block size), so a quick run keeps their
ratios.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pagedkv.bench.options import check_options, option

#: layer kinds (True: windowed) and window of each shape
SHAPES: dict[str, tuple[tuple[bool, ...], int]] = {
    "gemma2": ((True, False) * 2, 4096),
    "gemma3": ((True,) * 5 + (False,), 1024),
}
#: the ratios the shapes are expected to reach at 32k contexts
TARGETS = {"gemma2": 1.8, "gemma3": 4.0}
VOCAB = 512


@dataclass(frozen=True)
class HybridCapacityConfig:
    shapes: tuple[str, ...] = option(tuple(SHAPES), "model shapes", choices=tuple(SHAPES))
    context: int = option(32768, "tokens each request ends with", positive=True)
    scale: int = option(
        32, "divide the context, the windows, decode_tokens and the chunk by this", positive=True
    )
    budget_contexts: int = option(8, "the KV budget, in whole contexts without hybrid paging", positive=True)
    decode_tokens: int = option(4096, "tokens each request generates after its prompt", positive=True)
    block_size: int = option(16, "tokens per KV block", positive=True)
    max_num_batched_tokens: int = option(
        8192, "tokens a step computes (prompt chunks and decodes)", positive=True
    )
    model: str | None = option(None, "a windowed model's folder: its layer kinds and window, not the shapes")

    def __post_init__(self) -> None:
        check_options(self)
        if self.decode_tokens >= self.context:
            raise ValueError(f"decode_tokens ({self.decode_tokens}) must be below context ({self.context})")
        if self.max_num_batched_tokens < self.scale:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below scale ({self.scale})"
            )

    def layouts(self) -> dict[str, tuple[tuple[bool, ...], int]]:
        """Per shape measured: its layer kinds (True: windowed) and window, before scaling."""
        if self.model is None:
            return {shape: SHAPES[shape] for shape in self.shapes}
        return {Path(self.model).name: model_layout(Path(self.model))}


@dataclass
class ShapeRun:
    shape: str
    window: int
    context: int
    kv_budget_bytes: int
    #: per layer, whether it is windowed
    windowed: tuple[bool, ...] = ()
    #: per setting ("hybrid", "full"): blocks in the pool, most sequences running at once,
    #: requests that finished, blocks still held at the end
    pool_blocks: dict[str, int] = field(default_factory=dict)
    peak_running: dict[str, int] = field(default_factory=dict)
    finished: dict[str, int] = field(default_factory=dict)
    blocks_after: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.peak_running["hybrid"] / max(self.peak_running["full"], 1)

    def bound(self, block_size: int) -> float:
        """The ratio of layer-blocks a whole context holds without and with hybrid paging: what
        admission would reach if a prompt's windowed blocks were never held at once."""
        windowed = sum(self.windowed)
        layers = len(self.windowed)
        blocks = -(-self.context // block_size)
        window_blocks = min(-(-self.window // block_size) + 1, blocks)
        return layers * blocks / ((layers - windowed) * blocks + windowed * window_blocks)


@dataclass
class HybridCapacityResult:
    config: HybridCapacityConfig
    runs: list[ShapeRun]

    @property
    def ok(self) -> bool:
        return all(sum(run.blocks_after.values()) == 0 for run in self.runs)

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "runs": [
                asdict(run)
                | {
                    "ratio": run.ratio,
                    "bound": run.bound(self.config.block_size),
                    "target": TARGETS.get(run.shape),
                }
                for run in self.runs
            ],
        }


def model_layout(folder: Path) -> tuple[tuple[bool, ...], int]:
    """The layer kinds (True: windowed) and window of the model in ``folder``."""
    from pagedkv.models.config import ModelConfig

    config = ModelConfig.from_pretrained(folder)
    windows = [config.layer_sliding_window(layer) for layer in range(config.num_layers)]
    sized = {w for w in windows if w is not None}
    if len(sized) != 1:
        raise ValueError(
            f"{folder} has no single sliding window (per layer: {windows}): nothing to page by window"
        )
    return tuple(w is not None for w in windows), sized.pop()


def shape_config(windowed: tuple[bool, ...], context: int, window: int) -> dict[str, Any]:
    """config.json of a tiny model of the layer kinds ``windowed``, a ``window``-token window:
    Gemma 2's architecture when the kinds alternate, Gemma 3's text model's otherwise."""
    types = ["sliding_attention" if w else "full_attention" for w in windowed]
    alternating = all(w == (i % 2 == 0) for i, w in enumerate(windowed))
    arch, model_type = (
        ("Gemma2ForCausalLM", "gemma2") if alternating else ("Gemma3ForCausalLM", "gemma3_text")
    )
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": len(types),
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": window,
        "layer_types": types,
        "max_position_embeddings": context,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def run_hybrid_capacity(config: HybridCapacityConfig) -> HybridCapacityResult:
    runs = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-hybrid-") as tmp:
        for shape, layout in config.layouts().items():
            runs.append(_run_shape(config, shape, layout, Path(tmp)))
    return HybridCapacityResult(config, runs)


def _run_shape(
    config: HybridCapacityConfig, shape: str, layout: tuple[tuple[bool, ...], int], tmp: Path
) -> ShapeRun:
    from pagedkv import LLM, SamplingParams

    context, decode = config.context // config.scale, config.decode_tokens // config.scale
    windowed, window = layout[0], max(layout[1] // config.scale, 1)
    folder = tmp / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape_config(windowed, context, window)), encoding="utf-8")
    token_bytes = 2 * len(windowed) * 1 * 32 * 4  # keys and values, one KV head of 32 float32s per layer
    budget = config.budget_contexts * context * token_bytes
    run = ShapeRun(shape, window, context, budget, windowed)
    prompt = context - decode
    num_requests = 8 * config.budget_contexts
    for setting in ("hybrid", "full"):
        llm = LLM(
            str(folder),
            dtype="float32",
            load_format="dummy",
            skip_tokenizer_init=True,
            block_size=config.block_size,
            kv_cache_memory=budget,
            max_model_len=context,
            max_num_seqs=num_requests,
            max_num_batched_tokens=config.max_num_batched_tokens // config.scale,
            enable_prefix_caching=False,
            disable_hybrid_kv_cache_manager=setting == "full",
        )
        engine = llm.engine
        params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
        for i in range(num_requests):
            engine.add_request(str(i), [3 + (i * 7 + j) % (VOCAB - 3) for j in range(prompt)], params)
        peak = finished = 0
        while engine.has_unfinished_requests():
            finished += sum(out.finished for out in engine.step())
            peak = max(peak, len(engine.scheduler.running))
        run.pool_blocks[setting] = engine.kv_manager.usage().total_blocks
        run.peak_running[setting] = peak
        run.finished[setting] = finished
        run.blocks_after[setting] = engine.kv_manager.usage().used_blocks
        llm.shutdown()
    return run


def print_hybrid_capacity(result: HybridCapacityResult, console: Console) -> None:
    config = result.config
    table = Table(
        title=f"sequences held at one KV budget ({config.budget_contexts} whole contexts without hybrid "
        f"paging), contexts and windows / {config.scale}"
    )
    for column in (
        "shape",
        "context",
        "window",
        "pool blocks (hybrid / full)",
        "held: hybrid",
        "held: full",
        "ratio",
        "bound",
        "target",
    ):
        table.add_column(column)
    for run in result.runs:
        table.add_row(
            run.shape,
            str(run.context),
            str(run.window),
            f"{run.pool_blocks['hybrid']} / {run.pool_blocks['full']}",
            str(run.peak_running["hybrid"]),
            str(run.peak_running["full"]),
            f"{run.ratio:.2f}x",
            f"{run.bound(config.block_size):.2f}x",
            f">= {TARGETS[run.shape]}x" if run.shape in TARGETS else "",
        )
    console.print(table)
