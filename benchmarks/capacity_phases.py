"""Where each KV policy's engine spends a step: the demo's capacity run, phase by phase.

``pagedkv bench capacity`` reports each policy's throughput; this splits its time into the
step's phases (scheduling, the plan, the forward pass, sampling, output processing, the
statistics record), to see what one policy pays that another does not. It runs the demo's
configuration (64 requests of the ``normal`` mix at 1/8 scale, one torch thread) through one
engine per policy, stepped in turn, ``--rounds`` times in one process, and prints milliseconds
per round and the throughput ratios::

    .venv/bin/python benchmarks/capacity_phases.py --rounds 5

The phases are timed by wrapping the engine's own parts on each engine instance (its scheduler,
executor, sampler step and output processor); what the engine does is unchanged.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

from pagedkv.bench.capacity_config import CAPACITY_MAX_NUM_SEQS, CapacityConfig
from pagedkv.bench.driver import EngineOptions, MeasuredEngine, run_settings, step_in_turn
from pagedkv.engine import SamplingParams
from pagedkv.engine.kv_policy import KV_POLICIES
from pagedkv.engine.scheduler import SchedulerOutput

PHASES = ("schedule", "plan", "model", "sample", "process", "publish")


def _timed(owner: object, name: str, phase: str, totals: dict[str, float]) -> None:
    """Replace ``owner.name`` (on this instance) by a call that adds its time to ``totals``."""
    call: Callable = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            totals[phase] += time.perf_counter() - start

    setattr(owner, name, timed)


def _instrument(measured: MeasuredEngine, plans: dict[int, dict[str, float]]) -> dict[str, float]:
    """Time ``measured``'s phases into a new dict; its plans are timed through ``plans``."""
    engine, totals = measured.engine, defaultdict(float)
    _timed(engine.scheduler, "schedule", "schedule", totals)
    _timed(engine.executor, "execute", "model", totals)
    _timed(engine, "_sample", "sample", totals)
    _timed(engine.output_processor, "process", "process", totals)
    _timed(engine, "_publish", "publish", totals)
    plans[id(engine.kv_manager)] = totals
    return totals


def _time_plans(plans: dict[int, dict[str, float]]) -> None:
    """``SchedulerOutput.plan`` is the step's own object: timed once for every engine, each
    call counted for the engine whose KV manager it reads."""
    plan = SchedulerOutput.plan

    def timed(self: SchedulerOutput, kv_manager):
        start = time.perf_counter()
        try:
            return plan(self, kv_manager)
        finally:
            plans[id(kv_manager)]["plan"] += time.perf_counter() - start

    SchedulerOutput.plan = timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="runs of the workload (default: 5)")
    args = parser.parse_args()
    engine = EngineOptions(max_num_seqs=CAPACITY_MAX_NUM_SEQS, scale=8, threads=1)
    config = CapacityConfig(num_requests=64, kv_tokens=8 * 2048, seed=0, engine=engine)
    with run_settings(1):
        engines = {p.name: MeasuredEngine.start(config.engine_config(p)) for p in KV_POLICIES}
        plans: dict[int, dict[str, float]] = {}
        totals = {name: _instrument(measured, plans) for name, measured in engines.items()}
        _time_plans(plans)
        requests = config.requests(engines["paged"].engine.model_config.vocab_size)
        for r in range(args.rounds):
            for measured in engines.values():
                for i, (prompt, max_tokens) in enumerate(requests):
                    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    measured.submit(f"{r}-{i}", prompt, params)
            for _ in step_in_turn(list(engines.values())):
                pass
    print(f"ms per round of {len(requests)} requests ({args.rounds} rounds, engines stepped in turn)")
    print(f"{'':18}" + "".join(f"{p:>9}" for p in PHASES) + f"{'all':>9}{'steps':>7}")
    alls = {}
    for name, phases in totals.items():
        alls[name] = sum(phases[p] for p in PHASES)
        steps = len(engines[name].steps) / args.rounds
        cells = "".join(f"{phases[p] * 1e3 / args.rounds:9.1f}" for p in PHASES)
        print(f"{name:18}{cells}{alls[name] * 1e3 / args.rounds:9.1f}{steps:7.0f}")
    for name in ("contiguous", "contiguous-oracle"):
        print(f"paged / {name} throughput: {alls[name] / alls['paged']:.3f}")


if __name__ == "__main__":
    main()
