"""The op list is the forward pass: the torch interpreter runs it, the C decode stack is lowered
from it, and an op the stack cannot lower leaves the steps to the interpreter, saying why."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pagedkv.engine.worker.executor.base import runtime_of
from pagedkv.models import load_model
from pagedkv.models.decode_stack import decode_stack
from pagedkv.models.ops import AddNorm, Attend, DecoderOps, GateUpAct, Op, Project, RotaryWriteKV
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import make_checkpoint

from .paging import PagedBatch

LLAMA_LAYER = [AddNorm, Project, RotaryWriteKV, Attend, Project, AddNorm, GateUpAct, Project]
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
DECODES = [[[20 + i], [30 + i], [40 + i]] for i in range(4)]


@pytest.mark.parametrize(
    "arch,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 5})]
)
def test_each_family_lists_its_switches_in_the_ops(tmp_path, arch, overrides):
    model = load_model(make_checkpoint(tmp_path, arch, **overrides), dtype=torch.float32)
    ops = model.decoder_ops()
    assert len(ops.layers) == model.config.num_layers
    assert [type(op) for op in ops.layers[0]] == LLAMA_LAYER
    assert [type(op) for op in ops.final] == [AddNorm]
    qkv, rotary, attend = ops.layers[0][1:4]
    assert (qkv.linear.bias is not None) == (arch == "qwen2")
    assert (rotary.layout.q_norm is not None) == (arch == "qwen3")
    assert attend.options.sliding_window == overrides.get("sliding_window")


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_every_layer_writes_into_one_layers_kept_outputs(tmp_path, arch):
    """Steps in the interpreter: op j of every layer writes its output into the tensor of op j
    of the first layer, so the model keeps one layer's outputs, not one per layer; and the
    hidden states are those of a model whose layers keep their own (an output is dead by the
    time the next layer's op writes it)."""
    path = make_checkpoint(tmp_path, arch)
    shared, apart = (load_model(path, dtype=torch.float32, linear_kernel="tiled") for _ in range(2))
    for model in (shared, apart):
        ops = model.decoder_ops()
        flat = ops.sequence() if model is shared else tuple(op for layer in ops.layers for op in layer)
        model.step_program = StepProgram(flat if model is shared else (*flat, *ops.final))
    a, b = PagedBatch(shared, 24, 3), PagedBatch(apart, 24, 3)
    for step in [PROMPTS, *DECODES]:
        assert torch.equal(a.forward(step)[0], b.forward(step)[0])

    def kept(model) -> set[int]:
        outputs = [out for op in model.step_program.ops for out in op.kept_outputs()]
        return {tensor.data_ptr() for out in outputs for tensor in out.tensors()}

    layers = shared.config.num_layers
    assert layers > 1 and len(kept(apart)) == layers * len(kept(shared)) > 0


def _recorded(stack) -> list[bool]:
    """The stack's runs: True for a step it took, False for one it left to the interpreter."""
    taken: list[bool] = []
    run = stack.run

    def recording(*args):
        hidden = run(*args)
        taken.append(hidden is not None)
        return hidden

    stack.run = recording
    return taken


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stack_runs_whatever_the_op_list_says(tmp_path, arch, dtype):
    """An op list edited after the model was built -- its last layer left out -- runs in the C
    stack and in the interpreter with the same bits, and not those of the full list: the stack
    is lowered from the list, not written for the layer."""
    path = make_checkpoint(tmp_path, arch)
    stacked, plain, full = (load_model(path, dtype=dtype, linear_kernel="tiled") for _ in range(3))
    for model in (stacked, plain):
        ops = model.decoder_ops()
        shorter = DecoderOps(ops.layers[:-1], ops.final).sequence()
        stack = decode_stack(model, shorter, dtype) if model is stacked else None
        model.step_program = StepProgram(shorter, stack)
    taken = _recorded(stacked.step_program.stack)
    a, b, c = (PagedBatch(model, 24, 3) for model in (stacked, plain, full))
    for step in [PROMPTS, *DECODES]:
        got, want, whole = a.forward(step)[0], b.forward(step)[0], c.forward(step)[0]
        assert torch.equal(got, want)
        assert not torch.equal(got, whole)
    assert taken == [False] + [True] * len(DECODES)


@dataclass(frozen=True, eq=False)
class Scale(Op):
    """``x`` times a constant (Gemma scales its embedding so): an op without a C form."""

    factor: float

    def run(self, x, residual, batch):
        return x * self.factor, residual


def test_an_op_without_a_c_form_runs_in_the_interpreter_and_says_so(tmp_path):
    """A family that scales its embedding by 2 in an op of its own: the interpreter runs every
    step, with the bits of a model whose embedding is twice as large (exact in binary floating
    point) run by the C stack."""
    path = make_checkpoint(tmp_path, "llama")
    scaled = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    doubled = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    ops = scaled.decoder_ops()
    first = (Scale(2.0), *ops.layers[0])
    scaled.decoder_ops = lambda: DecoderOps((first, *ops.layers[1:]), ops.final)
    with torch.no_grad():
        doubled.model.embed_tokens.weight.mul_(2)
    assert runtime_of(scaled)["decode layers"] == "step program (no C form for Scale)"
    assert runtime_of(doubled)["decode layers"] == "C stack"
    a, b = PagedBatch(scaled, 24, 3), PagedBatch(doubled, 24, 3)
    for step in [PROMPTS, *DECODES]:
        assert torch.equal(a.forward(step)[0], b.forward(step)[0])
    assert scaled.step_program.stack is None and isinstance(scaled.step_program.ops[0], Scale)
    assert doubled.step_program.stack is not None
