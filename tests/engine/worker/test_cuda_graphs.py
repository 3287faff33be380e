"""Decode steps through CUDA graphs: padded to a captured batch size, replayed, and exactly the
eager steps' results.

On the CPU the padded steps run through the same code with ``capture=False`` (the model runs
eagerly over the graphs' input buffers): the padding, the scratch block and the buffers are
checked there, bit for bit against the unpadded runner. What needs the recording itself --
that graphs are captured, give the eager tokens, and that a step never waits for the device --
runs where a CUDA device is (``benchmarks/gpu_check.sh``).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.attention import KVCache
from pagedkv.engine.core.plan import StepPlan
from pagedkv.engine.worker.cuda_graphs import DecodeGraphSpec, eager_reason
from pagedkv.engine.worker.model_runner import ModelRunner
from pagedkv.engine.worker.step_inputs import capture_sizes
from pagedkv.models import load_model
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint
from tests.engine.plans import Piece, plan_of

#: Left out of the suite by its configuration (pyproject's addopts), run by gpu_check.sh.
needs_cuda = pytest.mark.cuda
BS = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("graphs"), "llama")


def _runners(path, dtype: str, device: str = "cpu", sizes=(1, 2, 4, 8), capture: bool = False):
    """An eager runner over a pool of 40 blocks, and one with decode graphs whose cache holds the
    same 40 blocks plus its scratch block."""
    model = load_model(path, dtype, device)
    spec, dtype = model.config.kv_spec(), model.config.dtype
    eager = ModelRunner(model, KVCache(spec, 40, BS, dtype, device))
    graphs = ModelRunner(model, KVCache(spec, 41, BS, dtype, device), DecodeGraphSpec(sizes, 64, capture))
    return eager, graphs


def _count_replays(runner: ModelRunner) -> list[bool]:
    """Whether each step the runner's graphs were asked about replayed (a step a graph does not
    hold runs eagerly)."""
    replays: list[bool] = []
    run = runner.graphs.run

    def counted(arrays):
        hidden = run(arrays)
        replays.append(hidden is not None)
        return hidden

    runner.graphs.run = counted
    return replays


def _steps() -> list[StepPlan]:
    """Prompts of three sequences, then decode steps of 3 (padded to 4), 1 and 2 sequences."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    tables = [[0, 1, 2, 3], [7, 8, 9, 10], [20, 21, 22, 23]]
    plans = [plan_of([Piece(p, 0, t, True, prompt_len=len(p)) for p, t in zip(prompts, tables, strict=True)])]
    lens = [len(p) for p in prompts]
    for rows in ([0, 1, 2], [1], [2, 0], [0, 1, 2]):
        plans.append(
            plan_of([Piece([30 + i], lens[i], tables[i], True, prompt_len=len(prompts[i])) for i in rows])
        )
        for i in rows:
            lens[i] += 1
    return plans


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_decode_steps_give_the_eager_logits_bit_for_bit_and_write_only_the_scratch_block(
    model_path, dtype
):
    eager, graphs = _runners(model_path, dtype)
    replays = _count_replays(graphs)
    for plan in _steps():
        assert torch.equal(graphs.execute(plan), eager.execute(plan))
        # every block of the pool holds what the eager runner wrote; the scratch block took the padding
        assert torch.equal(graphs.kv_cache.data[:, :, :40], eager.kv_cache.data)
    assert replays == [False, True, True, True, True]  # the prompt step runs eagerly
    assert graphs.kv_cache.data[:, :, 40, 0].abs().sum() > 0
    assert graphs.kv_cache.data[:, :, 40, 1:].abs().sum() == 0


def test_a_plan_that_names_the_scratch_block_is_refused(model_path):
    _, graphs = _runners(model_path, "float32")
    with pytest.raises(
        ValueError, match=r"block table \[40\] does not cover them with blocks of the pool's 40 "
    ):
        graphs.execute(plan_of([Piece([1, 2], 0, [40], True, prompt_len=2)]))


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (9, 14, 5, 20)]


def _workload(llm: LLM) -> list[list[list[int]]]:
    """Greedy requests, seeded samples that fork their prompt (n=3: copy-on-write of its last
    block) and a beam search; run on a pool small enough that sequences are preempted."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    forked = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    outs = llm.generate(_prompts(), [greedy, forked, greedy, forked], use_tqdm=False)
    beams = llm.beam_search(_prompts()[:2], BeamSearchParams(beam_width=3, max_tokens=6), use_tqdm=False)
    assert llm.kv_stats()["preemptions"] > 0 and llm.kv_stats()["blocks_used"] == 0
    return [[list(c.token_ids) for c in out.outputs] for out in outs + beams]


POOL = dict(
    dtype="float32", block_size=BS, num_kv_blocks=24, watermark=0.0, decode_headroom=0.0, max_num_seqs=8
)


def test_through_the_engine_padded_decode_steps_give_the_eager_tokens_with_forks_beams_and_preemption(
    model_path,
):
    """The engine's own plans -- forks, copy-on-write, beams, preemption and recomputation --
    through the padded path (the runner swapped for one whose cache has the scratch block)."""
    expected = _workload(LLM(str(model_path), **POOL))
    llm = LLM(str(model_path), **POOL)
    executor = llm.engine.executor
    old = executor.runner
    cache = KVCache(old.model.config.kv_spec(), 25, BS, old.kv_cache.dtype)
    executor.runner = ModelRunner(old.model, cache, DecodeGraphSpec(capture_sizes(8), 512, capture=False))
    replays = _count_replays(executor.runner)
    assert _workload(llm) == expected
    assert sum(replays) > 20


def test_describe_says_why_decode_steps_run_without_graphs(model_path):
    assert "cuda graphs off (cpu device: graphs are a CUDA feature)" in LLM(str(model_path)).engine.describe()
    assert "cuda graphs off (enforce_eager)" in LLM(str(model_path), enforce_eager=True).engine.describe()
    assert eager_reason("cuda", False, 2) == "off (tensor parallel: eager)"
    assert eager_reason("cuda:0", False, 1) is None


# -- on a CUDA device --------------------------------------------------------------------------------
@needs_cuda
def test_graphs_are_captured_for_every_size_and_give_the_eager_tokens(model_path):
    graphed = LLM(str(model_path), device="cuda", **POOL)
    assert "cuda graphs decode at batch sizes 1, 2, 4, 8" in graphed.engine.describe()
    graphs = graphed.engine.executor.runner.graphs
    assert sorted(graphs.steps) == [1, 2, 4, 8]
    assert all(step.graph is not None for step in graphs.steps.values())
    eager = LLM(str(model_path), device="cuda", enforce_eager=True, **POOL)
    assert eager.engine.executor.runner.graphs is None
    assert _workload(graphed) == _workload(eager)


@needs_cuda
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_step_never_waits_for_the_device(model_path, enforce_eager):
    """Prefill, decode (from a graph or eager) and a decode step with copy-on-write copies, under
    torch's sync debug mode: any host-device synchronisation inside the runner raises."""
    llm = LLM(
        str(model_path),
        device="cuda",
        dtype="float32",
        block_size=BS,
        num_kv_blocks=64,
        enforce_eager=enforce_eager,
    )
    runner = llm.engine.executor.runner
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    tables = [[0, 1, 2, 3], [7, 8, 9, 10], [20, 21, 22, 23]]

    def steps(offset: int) -> list[StepPlan]:
        lens = [len(p) + offset for p in prompts]
        prefill = plan_of(
            [
                Piece(p, offset, t, True, prompt_len=len(p) + offset)
                for p, t in zip(prompts, tables, strict=True)
            ]
        )
        decodes = [Piece([3], n, t, True, prompt_len=n) for n, t in zip(lens, tables, strict=True)]
        copied = plan_of(
            decodes[:2] + [Piece([4], lens[2], [20, 21, 22, 30], True, prompt_len=3)], [(23, 30)]
        )
        decode = plan_of(decodes)
        return [prefill, decode, copied]

    for plan in steps(0):  # compiles the kernels for these shapes
        runner.execute(plan)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for plan in steps(1):
            runner.execute(plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
