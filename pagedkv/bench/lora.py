"""``pagedkv bench lora``: unified paging against fixed adapter slots at one memory budget, and the
throughput of a batch over many adapters against the same batch on the base model.

Capacity, in the live engine (its admission decisions, as ``capacity-hybrid`` counts them): the
budget is what a fixed-slot engine takes -- ``max_loras`` slots at ``max_lora_rank``
(:func:`~pagedkv.bench.lora_adapters.slot_bytes`) plus ``kv_blocks`` KV blocks. The slots engine
(``lora_paging="slots"``) gets those ``kv_blocks``; the unified engine gets the whole budget as its
pool, the slots' bytes turned into blocks, and its adapters take pages of it at their own rank.
Two workloads:

* few adapters active, long contexts: ``active_adapters`` adapters, ``requests`` requests of
  ``context`` tokens all at once -- the most requests running at once;
* many adapters, short contexts: ``many_adapters`` adapters, one short request each, twice --
  the adapters resident after the first pass, and the adapter files read in the second (an
  adapter still resident is not read again).

Both engines run at most ``max_loras`` adapters in one step; the slots engine computes from
its slot tensors, the unified engine reads each adapter in its pages (no slot tensors).
Throughput: ``batch`` requests spread over ``adapters`` adapters of ``rank`` (warm: resident),
then the same batch on the base model, timed in alternating rounds (the figures are the best
round of each, and their ratio); cold load: a step that reads a new adapter against the same
step with a resident one. The built-in model unless ``--model``.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pagedkv.bench.driver import EngineOptions, run_settings
from pagedkv.bench.lora_adapters import slot_bytes, write_adapter
from pagedkv.bench.lora_capacity import LoraBudget
from pagedkv.bench.options import check_options, option

FIRST_TOKEN = 4
#: Tokens a request of the short-context workload ends with (prompt and generated).
SHORT_TOKENS = 6


@dataclass(frozen=True)
class LoraBenchConfig:
    max_loras: int = option(8, "adapter slots of each engine (the slots engine's reserve)", positive=True)
    max_lora_rank: int = option(16, "rank of the slots and of every adapter served", positive=True)
    kv_blocks: int = option(64, "KV blocks beside the fixed slots: the budget less the slots", positive=True)
    active_adapters: int = option(2, "adapters in use in the long-context workload", positive=True)
    requests: int = option(48, "requests of the long-context workload", positive=True)
    context: int = option(96, "tokens each long-context request ends with", positive=True)
    many_adapters: int = option(10, "adapters of the short-context workload", positive=True)
    batch: int = option(32, "requests of the throughput batch", positive=True)
    adapters: int = option(8, "adapters the throughput batch is spread over", positive=True)
    prompt_len: int = option(32, "prompt tokens of a throughput request", positive=True)
    max_tokens: int = option(32, "tokens a throughput request generates", positive=True)
    rounds: int = option(2, "alternating timed rounds of the LoRA and the base batch", positive=True)
    cold_loads: int = option(3, "new adapters whose first step is timed", positive=True)
    engine: EngineOptions = field(default_factory=EngineOptions)

    def __post_init__(self) -> None:
        check_options(self)
        if self.active_adapters > self.max_loras:
            raise ValueError(f"active_adapters ({self.active_adapters}) must be at most max_loras")


@dataclass
class LoraBenchResult:
    config: LoraBenchConfig
    #: the budget: block bytes, one slot's bytes, each engine's pool, one adapter's pages
    block_bytes: int = 0
    slot_bytes: int = 0
    pool_blocks: dict[str, int] = field(default_factory=dict)
    adapter_pages: int = 0
    #: per engine ("unified", "slots"): the most long-context requests running at once
    held_requests: dict[str, int] = field(default_factory=dict)
    #: per engine: adapters resident after one pass of the short requests, files read in a second
    resident_adapters: dict[str, int] = field(default_factory=dict)
    second_pass_reads: dict[str, int] = field(default_factory=dict)
    #: blocks still held once every request ended (must be 0: the pool is whole)
    blocks_after: dict[str, int] = field(default_factory=dict)
    lora_tokens_per_s: float = 0.0
    base_tokens_per_s: float = 0.0
    cold_load_s: float = 0.0

    @property
    def throughput_ratio(self) -> float:
        return self.lora_tokens_per_s / self.base_tokens_per_s if self.base_tokens_per_s else 0.0

    @property
    def ok(self) -> bool:
        return not any(self.blocks_after.values())

    def budget(self) -> LoraBudget:
        """The budget as :mod:`pagedkv.bench.lora_capacity` divides it (its closed forms)."""
        config = self.config
        return LoraBudget(
            config.max_loras * self.slot_bytes + config.kv_blocks * self.block_bytes,
            self.block_bytes,
            config.engine.run_block_size,
            self.adapter_pages,
            self.slot_bytes,
            config.max_loras,
        )

    def to_json(self) -> dict[str, Any]:
        config, budget = self.config, self.budget()
        bounds = {
            "held_requests": asdict(budget.concurrent_requests(config.context, config.active_adapters)),
            "resident_adapters": asdict(budget.resident_adapters(SHORT_TOKENS, 0)),
        }
        return asdict(self) | {"throughput_ratio": self.throughput_ratio, "closed_form": bounds}


def run_lora_bench(config: LoraBenchConfig) -> LoraBenchResult:
    from pagedkv import LLM

    result = LoraBenchResult(config)
    with run_settings(config.engine.threads), tempfile.TemporaryDirectory(prefix="pagedkv-lora-") as tmp:
        probe = LLM(**_options(config, 8, "unified"))
        model_config, executor = probe.engine.model_config, probe.engine.executor
        result.block_bytes = executor.kv_memory.total_bytes // executor.num_kv_blocks
        element = model_config.dtype.itemsize
        probe.shutdown()
        result.slot_bytes = slot_bytes(model_config, config.max_lora_rank, element)
        reserve = config.max_loras * result.slot_bytes
        result.pool_blocks = {
            "unified": config.kv_blocks + reserve // result.block_bytes,
            "slots": config.kv_blocks,
        }
        count = max(config.many_adapters, config.adapters + config.cold_loads)
        folders = [
            write_adapter(Path(tmp, f"a{i}"), model_config, config.max_lora_rank, i) for i in range(count)
        ]
        for paging in ("unified", "slots"):
            _capacity(config, result, paging, folders)
        _throughput(config, result, folders)
    return result


def _options(config: LoraBenchConfig, blocks: int, paging: str) -> dict[str, Any]:
    max_len = max(config.context, config.prompt_len + config.max_tokens) + 16
    engine = config.engine.engine_config(blocks, max_len, max_num_seqs=max(config.requests, config.batch, 8))
    options = {f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)}
    return options | dict(
        enable_lora=True, max_loras=config.max_loras, max_lora_rank=config.max_lora_rank, lora_paging=paging
    )


def _requests(folders: list[Path], ids: range) -> list[Any]:
    from pagedkv import LoRARequest

    return [LoRARequest(f"adapter-{i}", i + 1, str(folders[i])) for i in ids]


def _capacity(config: LoraBenchConfig, result: LoraBenchResult, paging: str, folders: list[Path]) -> None:
    from pagedkv import LLM, SamplingParams

    llm = LLM(**_options(config, result.pool_blocks[paging], paging))
    engine = llm.engine
    decode = 4
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    active = _requests(folders, range(config.active_adapters))
    if paging == "unified":
        engine.add_lora(active[0])
        result.adapter_pages = engine.scheduler.paged_adapters.pages_of(active[0].lora_int_id)
    prompt = config.context - decode
    for i in range(config.requests):
        tokens = [FIRST_TOKEN + (i * 7 + j) % 200 for j in range(prompt)]
        engine.add_request(f"long-{i}", tokens, params, lora_request=active[i % len(active)])
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    result.held_requests[paging] = peak
    many = _requests(folders, range(config.many_adapters))
    short = SamplingParams(max_tokens=SHORT_TOKENS - 4, temperature=0.0, ignore_eos=True)
    reads = []
    for round_ in range(2):
        before = _reads(engine)
        for i, lora in enumerate(many):
            engine.add_request(f"short-{round_}-{i}", [FIRST_TOKEN + i, 9, 14, 5], short, lora_request=lora)
        while engine.has_unfinished_requests():
            engine.step()
        reads.append(_reads(engine) - before)
        if round_ == 0:
            paged = engine.scheduler.paged_adapters
            resident = engine.scheduler.adapters.slots() if paged is None else paged.pages.resident()
            result.resident_adapters[paging] = len(resident)
    result.second_pass_reads[paging] = reads[1]
    result.blocks_after[paging] = engine.kv_manager.usage().used_blocks
    llm.shutdown()


def _reads(engine: Any) -> int:
    """Adapter files read so far: into pages (unified paging) or into slots."""
    paged = engine.scheduler.paged_adapters
    return engine.scheduler.adapters.loads if paged is None else paged.pages.num_loads


def _throughput(config: LoraBenchConfig, result: LoraBenchResult, folders: list[Path]) -> None:
    from pagedkv import LLM, SamplingParams

    blocks = config.batch * -(-(config.prompt_len + config.max_tokens) // config.engine.run_block_size) * 2
    llm = LLM(**_options(config, blocks + 64 * config.adapters, "unified"))
    params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [
        [FIRST_TOKEN + (i * 13 + j) % 200 for j in range(config.prompt_len)] for i in range(config.batch)
    ]
    loras = _requests(folders, range(config.adapters))
    spread = [loras[i % len(loras)] for i in range(config.batch)]
    llm.generate(prompts[: len(loras)], SamplingParams(max_tokens=1), lora_request=loras, use_tqdm=False)
    lora_rates, base_rates = [], []
    for _ in range(config.rounds):
        for rates, batch_loras in ((lora_rates, spread), (base_rates, None)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=batch_loras, use_tqdm=False)
            generated = sum(len(out.outputs[0].token_ids) for out in outs)
            rates.append(generated / (time.perf_counter() - start))
    result.lora_tokens_per_s, result.base_tokens_per_s = max(lora_rates), max(base_rates)
    one = SamplingParams(max_tokens=1)
    cold = []
    for lora in _requests(folders, range(config.adapters, config.adapters + config.cold_loads)):
        start = time.perf_counter()
        llm.generate([prompts[0]], one, lora_request=lora, use_tqdm=False)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompts[0]], one, lora_request=lora, use_tqdm=False)
        cold.append(cold_s - (time.perf_counter() - start))
    result.cold_load_s = statistics.median(cold)
    llm.shutdown()


def print_lora_bench(result: LoraBenchResult, console: Console) -> None:
    config, budget = result.config, result.budget()
    held = budget.concurrent_requests(config.context, config.active_adapters)
    resident = budget.resident_adapters(SHORT_TOKENS, 0)
    table = Table(
        title=f"one budget of {budget.budget_bytes / 2**20:.2f} MiB: "
        f"{config.max_loras} slots of rank {config.max_lora_rank} "
        f"({result.slot_bytes / 2**10:.0f} KiB each) + {config.kv_blocks} KV blocks, or one pool; "
        f"an adapter takes {result.adapter_pages} pages of {result.block_bytes / 2**10:.0f} KiB"
    )
    for column in ("workload", "unified paging", "fixed slots", "closed form (unified / slots)"):
        table.add_column(column)
    table.add_row("pool blocks", str(result.pool_blocks["unified"]), str(result.pool_blocks["slots"]))
    table.add_row(
        f"requests held ({config.active_adapters} adapters, {config.context}-token contexts)",
        str(result.held_requests["unified"]),
        str(result.held_requests["slots"]),
        f"{held.unified} / {held.slots}",
    )
    table.add_row(
        f"adapters resident ({config.many_adapters} adapters, short contexts)",
        str(result.resident_adapters["unified"]),
        str(result.resident_adapters["slots"]),
        f"{resident.unified} / {resident.slots}",
    )
    table.add_row(
        "adapter files read again in a second pass",
        str(result.second_pass_reads["unified"]),
        str(result.second_pass_reads["slots"]),
    )
    console.print(table)
    speed = Table(
        title=f"{config.batch} requests over {config.adapters} adapters of rank {config.max_lora_rank}"
    )
    for column in ("LoRA tok/s", "base tok/s", "ratio", "cold adapter load"):
        speed.add_column(column)
    speed.add_row(
        f"{result.lora_tokens_per_s:.1f}",
        f"{result.base_tokens_per_s:.1f}",
        f"{result.throughput_ratio:.2f}x",
        f"{result.cold_load_s * 1e3:.1f} ms",
    )
    console.print(speed)
