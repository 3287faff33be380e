"""The capacity benchmark's run: workload, KV budget, context length and engine options."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedkv.bench.driver import EngineOptions
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.kv_policy import KVPolicy
from pagedkv.sim.workloads import Workload

#: Workloads without shared prefixes: with sharing, "tokens stored" would count a block twice.
WORKLOADS = ("normal", "sharegpt")
#: The sequence budget of the capacity runs: high enough that the KV pool, not the number of
#: sequences per step, is what limits how many requests run at once.
CAPACITY_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class CapacityConfig:
    """The run. The engine options' ``scale`` divides every length -- prompts, outputs,
    ``max_model_len``, the KV budget, the block size and the per-step token budget -- so a scaled
    run keeps the shape of the full one with ``scale`` times fewer tokens."""

    workload: str = "normal"
    num_requests: int = 128
    kv_tokens: int = 16 * 2048
    max_model_len: int = 2048
    seed: int = 0
    engine: EngineOptions = field(default_factory=lambda: EngineOptions(max_num_seqs=CAPACITY_MAX_NUM_SEQS))
    #: Runs of the whole workload: every policy's schedule is the same each time, so each step's
    #: time is taken as its least over the runs (what a burst of other work did not disturb).
    repeats: int = 1

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        for name in ("num_requests", "kv_tokens", "max_model_len", "repeats"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name, value in (
            ("max_model_len", self.max_model_len),
            ("kv_tokens", self.kv_tokens),
            ("max_num_batched_tokens", self.engine.max_num_batched_tokens),
        ):
            if value % self.scale:
                raise ValueError(f"scale {self.scale} must divide {name} ({value})")
        if self.max_model_len // self.scale < 2:
            raise ValueError(f"max_model_len {self.max_model_len} / scale {self.scale} leaves < 2 tokens")
        if self.kv_tokens < self.max_model_len:
            raise ValueError(
                f"a KV budget of {self.kv_tokens} tokens cannot hold even one contiguous reservation "
                f"of max_model_len={self.max_model_len} tokens"
            )
        if (self.kv_tokens // self.scale) % self.run_block_size:
            raise ValueError(
                f"the KV budget ({self.kv_tokens} tokens / scale {self.scale}) must be a whole number "
                f"of {self.run_block_size}-token blocks"
            )

    @property
    def scale(self) -> int:
        return self.engine.scale

    @property
    def run_max_model_len(self) -> int:
        return self.max_model_len // self.scale

    @property
    def run_block_size(self) -> int:
        return self.engine.run_block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_tokens // self.scale // self.run_block_size

    def engine_config(self, policy: KVPolicy) -> EngineConfig:
        # No watermark: the budget is exactly kv_tokens for every policy, so contiguous-max
        # fits exactly kv_tokens // max_model_len requests. No prefix cache either: the
        # contiguous policies cannot have one, these workloads share no prefix for it to find,
        # and registering every computed block and evicting one per new block cost the paged
        # engine alone ~5 % of its steps (at the demo's 2-token blocks), so the runs would
        # differ in more than their KV policy. ``pagedkv bench sharing`` measures the cache.
        return self.engine.engine_config(
            self.num_kv_blocks, self.run_max_model_len, enable_prefix_caching=False, kv_policy=policy
        )

    def requests(self, vocab_size: int) -> list[tuple[list[int], int]]:
        """(prompt token ids, max_tokens) per request: the simulator's lengths for this workload
        and seed, divided by ``scale``; token ids drawn from the vocabulary with the same seed."""
        lengths = Workload(self.workload, self.max_model_len).sample(
            np.random.default_rng(self.seed), self.num_requests
        )
        token_rng = np.random.default_rng([self.seed, 1])
        requests = []
        for r in lengths:
            prompt = max(1, r.prompt_len // self.scale)
            output = max(1, min(r.output_len // self.scale, self.run_max_model_len - prompt))
            requests.append((token_rng.integers(0, vocab_size, prompt).tolist(), output))
        return requests
