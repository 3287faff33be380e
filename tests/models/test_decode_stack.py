"""The C decode stack (pagedkv.models.decode_stack) against the step program it stands in for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from pagedkv.attention import set_per_call_checks
from pagedkv.engine.worker.executor.base import runtime_of
from pagedkv.kernels.tiled_gemm import to_tiles
from pagedkv.memory.kv_groups import plan_kv_groups
from pagedkv.models import load_model
from pagedkv.models.linear import BUFFER_ROWS
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import make_checkpoint

from .paging import PagedBatch
from .test_gemma2 import GEMMA2, GEMMA3
from .test_moe import MIXTRAL, QWEN2MOE, QWEN3MOE


def _with_stack(model) -> tuple[object, list[bool]]:
    """The model's stack, its runs recorded: True for a step it took, False for one it left."""
    model.step_program = StepProgram.of(model)
    stack = model.step_program.stack
    assert stack is not None, "this model's decode steps should run in the C stack"
    taken: list[bool] = []
    run = stack.run

    def recording(*args):
        hidden = run(*args)
        taken.append(hidden is not None)
        return hidden

    stack.run = recording
    return stack, taken


def _without_stack(model) -> None:
    model.step_program = dataclasses.replace(StepProgram.of(model), stack=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),  # q/k/v biases
        ("qwen3", {}),  # q/k norms
        ("mistral", {"sliding_window": 5}),
        ("llama", {"num_key_value_heads": 4}),  # one query head per KV head
        ("gemma2", GEMMA2),  # offset norms, sandwich norms, GeGLU, soft-capped attention
        ("gemma3", GEMMA3),  # offset q/k norms, the sliding layers' own rotary table
        ("mixtral", MIXTRAL),  # the routed experts: float32 weights
        ("qwen3moe", QWEN3MOE),  # renormalised top-3, weights in the model's dtype
        ("qwen2moe", QWEN2MOE),  # the gated shared expert, a dense layer
        # Phi-4-mini's partial rotary: the whole-head rotation of the loader's reordered rows, by
        # tables of cos 1 and sin 0 on the dimensions that pass
        ("phi3", {"partial_rotary_factor": 0.75}),
    ],
)
def test_the_stack_gives_the_programs_hidden_states_bit_for_bit(tmp_path, dtype, arch, overrides):
    path = make_checkpoint(tmp_path, arch, **overrides)
    stacked = load_model(path, dtype=dtype, linear_kernel="tiled")
    plain = load_model(path, dtype=dtype, linear_kernel="tiled")
    _, taken = _with_stack(stacked)
    _without_stack(plain)
    a, b = PagedBatch(stacked, 24, 3), PagedBatch(plain, 24, 3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    for step in [prompts] + [[[20 + i], [30 + i], [40 + i]] for i in range(8)]:
        got, _ = a.forward(step)
        want, _ = b.forward(step)
        assert torch.equal(got, want)
    assert taken == [False] + [True] * 8  # the prompt step runs the program, every decode the stack


#: Qwen2 with its first layer full and the second sliding: two KV groups under hybrid paging
QWEN2_HYBRID = {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,overrides", [("qwen2", QWEN2_HYBRID), ("gemma2", GEMMA2)])
def test_grouped_steps_read_each_layers_group_tables_bit_for_bit(tmp_path, dtype, arch, overrides):
    """Hybrid paging: each KV group's slots and block tables on blocks of its own, so a layer
    that read another group's would write and attend the wrong blocks."""
    path = make_checkpoint(tmp_path, arch, **overrides)
    stacked = load_model(path, dtype=dtype, linear_kernel="tiled")
    plain = load_model(path, dtype=dtype, linear_kernel="tiled")
    config = stacked.config
    groups = plan_kv_groups([config.layer_sliding_window(i) for i in range(config.num_layers)])
    assert groups is not None and groups.num_groups >= 2
    _, taken = _with_stack(stacked)
    _without_stack(plain)
    a, b = PagedBatch(stacked, 24, 3, groups=groups), PagedBatch(plain, 24, 3, groups=groups)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    for step in [prompts] + [[[20 + i], [30 + i], [40 + i]] for i in range(8)]:
        got, _ = a.forward(step)
        want, _ = b.forward(step)
        assert torch.equal(got, want)
    assert taken == [False] + [True] * 8
    for mine, theirs in zip(a.kv_cache.layers, b.kv_cache.layers, strict=True):
        assert torch.equal(mine.key, theirs.key) and torch.equal(mine.value, theirs.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("mistral", {"sliding_window": 5})])
def test_verification_rows_run_in_the_stack_bit_for_bit(tmp_path, dtype, arch, overrides):
    """Steps of several generated rows per sequence (speculative decoding's ``k + 1`` rows,
    beside plain decodes): each row attends its sequence up to its own position, as the
    program's prefill attention computes it, and the stack gives the same bits."""
    path = make_checkpoint(tmp_path, arch, **overrides)
    stacked = load_model(path, dtype=dtype, linear_kernel="tiled")
    plain = load_model(path, dtype=dtype, linear_kernel="tiled")
    _, taken = _with_stack(stacked)
    _without_stack(plain)
    a, b = PagedBatch(stacked, 32, 3), PagedBatch(plain, 32, 3)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    lens = [len(p) for p in prompts]
    steps = [
        prompts,
        [[20, 21, 22], [30], [40, 41, 42, 43, 44]],
        [[23], [31, 32], [45]],
        [[24, 25], [33], [46]],
    ]
    for step in steps:
        got, _ = a.forward(step, prompt_lens=lens)
        want, _ = b.forward(step, prompt_lens=lens)
        assert torch.equal(got, want)
    assert taken == [False, True, True, True]
    for mine, theirs in zip(a.kv_cache.layers, b.kv_cache.layers, strict=True):
        assert torch.equal(mine.key, theirs.key) and torch.equal(mine.value, theirs.value)


def test_rows_of_a_prompt_or_of_unknown_kind_go_to_the_program(tmp_path):
    """A multi-row step takes the stack only when every row is past its prompt, which it can
    tell only from the prompt lengths."""
    model = load_model(make_checkpoint(tmp_path, "llama"), dtype=torch.float32, linear_kernel="tiled")
    _, taken = _with_stack(model)
    batch = PagedBatch(model, 24, 2)
    batch.forward([[1, 2, 3], [4, 5]], prompt_lens=[6, 2])  # a first chunk of the first prompt
    batch.forward([[6, 7, 8], [9, 10]], prompt_lens=[6, 2])  # its last chunk beside two generated rows
    batch.forward([[11, 12], [13, 14]])  # generated rows, but no prompt lengths to say so
    batch.forward([[15, 16], [17, 18]], prompt_lens=[6, 2])
    assert taken == [False, False, False, True]


def test_the_stack_leaves_to_the_program_what_it_does_not_take(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    _, taken = _with_stack(model)
    batch = PagedBatch(model, 8, BUFFER_ROWS + 1)
    batch.forward([[1]] * (BUFFER_ROWS + 1))  # one-token prompts: a prefill step
    batch.forward([[2]] * (BUFFER_ROWS + 1))  # a decode step wider than the stack's buffers
    previous = set_per_call_checks(True)  # the checks run in the program
    try:
        batch.forward([[3]] * (BUFFER_ROWS + 1))
    finally:
        set_per_call_checks(previous)
    assert taken == [False, False, False]
    small = PagedBatch(model, 8, 2)
    small.forward([[1, 2], [3]])
    small.forward([[4], [5]])
    assert taken[-2:] == [False, True]


@pytest.mark.parametrize(
    "options", [{"linear_kernel": "torch"}, {"linear_kernel": "onednn"}, {"attention_backend": "torch"}]
)
def test_a_model_without_every_compiled_kernel_has_no_stack(tmp_path, options):
    model = load_model(make_checkpoint(tmp_path, "llama"), dtype=torch.float32, **options)
    assert StepProgram.of(model).stack is None


def test_a_decode_step_writes_the_same_keys_and_values_as_the_program(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    stacked = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    plain = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    _with_stack(stacked)
    _without_stack(plain)
    a, b = PagedBatch(stacked, 12, 2), PagedBatch(plain, 12, 2)
    for step in ([[1, 2, 3], [4]], [[5], [6]], [[7], [8]]):
        a.forward(step)
        b.forward(step)
    for mine, theirs in zip(a.kv_cache.layers, b.kv_cache.layers, strict=True):
        assert torch.equal(mine.key, theirs.key) and torch.equal(mine.value, theirs.value)


@pytest.mark.parametrize("tiled", [True, False])
def test_a_weight_replaced_after_the_stack_ran_is_the_one_it_reads(tmp_path, tiled):
    """A reload or repacking may put a new tensor in a projection's parameter table; the stack
    reads the new one (tiled) or leaves the step to the program (not tiled), as the program does."""
    path = make_checkpoint(tmp_path, "llama")
    stacked = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    plain = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    _, taken = _with_stack(stacked)
    _without_stack(plain)
    a, b = PagedBatch(stacked, 12, 2), PagedBatch(plain, 12, 2)
    for step in ([[1, 2, 3], [4]], [[5], [6]]):
        a.forward(step)
        b.forward(step)
    o_proj = stacked.model.layers[0].self_attn.o_proj
    new = torch.randn(o_proj.out_features, o_proj.in_features, generator=torch.Generator().manual_seed(1))
    weight = to_tiles(new) if tiled else new
    for model in (stacked, plain):
        model.model.layers[0].self_attn.o_proj.weight = nn.Parameter(weight.clone(), requires_grad=False)
    got, _ = a.forward([[7], [8]])
    want, _ = b.forward([[7], [8]])
    assert torch.equal(got, want)
    assert taken == [False, True, tiled]


@pytest.mark.parametrize(
    "options,line",
    [
        ({"linear_kernel": "tiled"}, "C stack"),
        ({"linear_kernel": "onednn"}, "step program (linear layers not on the tiled kernel)"),
        ({"attention_backend": "torch"}, "step program (attention backend 'torch')"),
    ],
)
def test_the_runtime_line_says_what_runs_the_decode_layers(tmp_path, options, line):
    model = load_model(make_checkpoint(tmp_path, "llama"), dtype=torch.float32, **options)
    assert runtime_of(model)["decode layers"] == line
