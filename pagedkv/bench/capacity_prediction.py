"""What the capacity benchmark expects before it runs: the simulator's prediction and a closed form."""

from __future__ import annotations

import numpy as np

from pagedkv.bench.capacity_config import CapacityConfig
from pagedkv.bench.driver import mean
from pagedkv.engine.kv_policy import CONTIGUOUS, CONTIGUOUS_ORACLE, KV_POLICIES, PAGED
from pagedkv.sim.experiments import capacity
from pagedkv.sim.workloads import Workload

#: The simulator's allocator that models each engine policy.
SIM_ALLOCATORS = {PAGED: "paged", CONTIGUOUS: "max", CONTIGUOUS_ORACLE: "oracle"}
#: The simulator's capacity figure is one random snapshot; its prediction averages this many.
SIM_DRAWS = 16


def simulator_prediction(config: CapacityConfig, draws: int = SIM_DRAWS) -> dict[str, float]:
    """Concurrent requests per policy that the simulator predicts for this workload and budget.

    Its ``capacity`` experiment fills the budget with requests at uniformly random progress (the
    steady state of a busy server) until one does not fit; the mean of ``draws`` such snapshots
    at full scale (ratios do not depend on ``scale``)."""
    workload = Workload(config.workload, config.max_model_len)
    snapshots = [
        capacity(workload, config.kv_tokens, config.engine.block_size, rng)
        for rng in np.random.default_rng(config.seed).spawn(draws)
    ]
    return {p.name: mean([s[SIM_ALLOCATORS[p]] for s in snapshots]) for p in KV_POLICIES}


def length_biased_prediction(
    config: CapacityConfig, requests: list[tuple[list[int], int]]
) -> dict[str, float]:
    """Concurrent requests per policy expected once the batch is full, in closed form.

    In a full batch a request keeps its place for as many steps as it generates tokens, so the
    running set is a length-biased sample of the workload: a request is found there in proportion
    to its ``max_tokens``, where the simulator's snapshot takes every request equally. The KV a
    policy holds for a request, averaged over its decode steps and weighted so, is the mean held
    per running request; the budget divided by it is the expected count."""
    bs = config.run_block_size
    held = dict.fromkeys(KV_POLICIES, 0)
    steps = 0
    for prompt_ids, output in requests:
        prompt = len(prompt_ids)
        stored = prompt + np.arange(output)  # tokens held at each of its decode steps
        for policy in KV_POLICIES:
            reserved = policy.reserved_tokens(prompt, output, config.run_max_model_len)
            held[policy] += int((-(-np.maximum(stored, reserved) // bs)).sum()) * bs
        steps += output
    budget = config.num_kv_blocks * bs
    return {policy.name: budget * steps / held[policy] for policy in KV_POLICIES}
