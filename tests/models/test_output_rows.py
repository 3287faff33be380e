"""A forward pass asked for some rows only (a prompt's last token): the same hidden states for
those rows, the same KV cache, and the last layer's projections run on those rows alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.ops import Op, Project
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import make_checkpoint

from .paging import PagedBatch

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
LAST_ROWS = [4, 6, 13]  # each prompt's last token in the packed batch


class _Recording(Op):
    """An op that records the rows it receives, then runs the op it stands in for."""

    def __init__(self, op: Op, seen: list[int]) -> None:
        self.op, self.seen = op, seen

    def run(self, x, residual, batch):
        self.seen.append(x.shape[0])
        return self.op.run(x, residual, batch)


def _count_last_layer_rows(model) -> list[int]:
    """The rows every call of the last layer's output projection received, recorded."""
    program = StepProgram.of(model)
    seen: list[int] = []
    o_proj = model.model.layers[-1].self_attn.o_proj
    ops = tuple(
        _Recording(op, seen) if isinstance(op, Project) and op.linear is o_proj else op for op in program.ops
    )
    assert sum(isinstance(op, _Recording) for op in ops) == 1
    model.step_program = dataclasses.replace(program, ops=ops)
    return seen


# The tiled kernel computes each row alone, so fewer rows give the same bits; F.linear (MKL) blocks
# rows differently at another M, so its rows agree only to float32 rounding.
@pytest.mark.parametrize(
    "arch,dtype,kernel,tolerance",
    [
        ("llama", torch.float32, "tiled", 0.0),
        ("llama", torch.float32, "torch", 1e-5),
        ("llama", torch.bfloat16, "tiled", 0.0),
        ("qwen3", torch.float32, "tiled", 0.0),
        ("mistral", torch.float32, "tiled", 0.0),
    ],
)
def test_selected_rows_are_the_full_pass_rows(tmp_path, arch, dtype, kernel, tolerance):
    overrides = {"sliding_window": 5} if arch == "mistral" else {}
    path = make_checkpoint(tmp_path, arch, **overrides)
    selected_model = load_model(path, dtype=dtype, linear_kernel=kernel)
    full_model = load_model(path, dtype=dtype, linear_kernel=kernel)
    seen = _count_last_layer_rows(selected_model)
    selected, full = PagedBatch(selected_model, 24, 3), PagedBatch(full_model, 24, 3)
    got, _ = selected.forward(PROMPTS, LAST_ROWS)
    want, _ = full.forward(PROMPTS)
    torch.testing.assert_close(got, want[LAST_ROWS], rtol=tolerance, atol=tolerance)
    assert seen == [len(LAST_ROWS)]  # the prompt's other rows skipped the last layer's projections
    for layer in range(len(selected.kv_cache.layers)):  # every row's keys and values were written
        assert torch.equal(selected.kv_cache.layers[layer].key, full.kv_cache.layers[layer].key)
        assert torch.equal(selected.kv_cache.layers[layer].value, full.kv_cache.layers[layer].value)
    for i in range(3):  # and the decode steps that read them agree
        step = [[20 + i], [30 + i], [40 + i]]
        assert torch.equal(selected.forward(step)[0], full.forward(step)[0])


def test_no_rows_asked_means_every_row(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, dtype=torch.float32, linear_kernel="tiled")
    seen = _count_last_layer_rows(model)
    hidden, cu = PagedBatch(model, 24, 3).forward(PROMPTS)
    assert hidden.shape[0] == cu[-1] == 14
    assert seen == [14]
