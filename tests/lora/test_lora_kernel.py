"""The C BGMV kernel (``pagedkv.kernels.lora_bgmv``) against a float64 reference of each row's
own adapter product, on slot tensors laid out by the model's own :class:`ModuleSlots`; and
the C decode stack's LoRA records against the step program, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.kernels.lora_bgmv import lora_bgmv
from pagedkv.models import load_model
from pagedkv.models.lora import LoRASlots, ModuleSlots
from pagedkv.models.ops import LoRARows
from pagedkv.models.step_program import StepProgram
from tests.checkpoints import make_checkpoint
from tests.models.paging import PagedBatch

#: each packed module of a small GQA model: its input width and its checkpoint projections' widths
MODULES = {
    "qkv_proj": (64, {"q_proj": 64, "k_proj": 32, "v_proj": 32}),
    "o_proj": (64, {"o_proj": 64}),
    "gate_up_proj": (64, {"gate_proj": 96, "up_proj": 96}),
    "down_proj": (96, {"down_proj": 64}),
}
#: each row's slot: three adapters (five rows of slot 2: a group of four computed together, and
#: one more), base rows (-1) between them, and slot 3 never used
ROW_SLOTS = [-1, 0, 2, 1, 0, -1, 2, 2, 1, 2, 2]
SCALING = torch.tensor([2.0, 0.5, 1.25, 3.0])


def _module(name: str, rank: int, dtype: torch.dtype) -> ModuleSlots:
    """Four slots of ``name``: slots 0 and 2 hold adapters of ``rank``, slot 1 one of half the
    rank (zero-padded), slot 3 none."""
    n_in, widths = MODULES[name]
    shapes = {shard: (n_in, width) for shard, width in widths.items()}
    slots = ModuleSlots(shapes, tuple(widths), 4, rank, torch.empty(0, dtype=dtype))
    gen = torch.Generator().manual_seed(rank)
    for slot, r in ((0, rank), (1, rank // 2), (2, rank)):
        for shard, width in widths.items():
            a = torch.randn(r, n_in, generator=gen) / n_in**0.5
            b = torch.randn(width, r, generator=gen) / r**0.5
            slots.put(slot, shard, a, b)
    return slots


def _reference(x: torch.Tensor, y: torch.Tensor, slots: ModuleSlots) -> torch.Tensor:
    """``y`` plus each row's ``scaling * B (A x)`` in float64, over the whole slot tensors."""
    out = y.double()
    for row, slot in enumerate(ROW_SLOTS):
        if slot >= 0:
            a, b = slots.a[slot].double(), slots.b[slot].double()
            out[row] += SCALING[slot].double() * ((x[row].double() @ a.t()) @ b)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 12, 16, 64])  # 12: rank rows in blocks of 8 and a rest
@pytest.mark.parametrize("name", list(MODULES))
def test_each_row_gets_its_own_adapter(name, rank, dtype):
    slots = _module(name, rank, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(ROW_SLOTS), slots.a.shape[2], generator=gen).to(dtype)
    y = torch.randn(len(ROW_SLOTS), slots.b.shape[2], generator=gen).to(dtype)
    row_slot = torch.tensor(ROW_SLOTS, dtype=torch.int32)
    got = lora_bgmv(x, slots.a, slots.b, row_slot, SCALING, slots.columns, y.clone())
    want = _reference(x, y, slots)
    assert not torch.allclose(want, y.double(), atol=0.1)  # the adapters change the rows
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # rounded once to bfloat16 (8 significant bits)
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)
    base = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    assert torch.equal(got[base], y[base])  # a row of no adapter is left as it was
    for row in range(len(ROW_SLOTS)):  # a row's sums do not depend on the rows beside it
        alone = lora_bgmv(
            x[row : row + 1],
            slots.a,
            slots.b,
            row_slot[row : row + 1],
            SCALING,
            slots.columns,
            y[row : row + 1].clone(),
        )
        assert torch.equal(alone[0], got[row])


@pytest.mark.parametrize("name", list(MODULES))
def test_the_dense_product_off_the_kernel_gives_the_same_rows(name):
    """Where the kernel does not run (float16 on the CPU; CUDA without triton), :meth:`LoRARows.add`
    is the dense product over every slot, each row masked to its own."""
    slots = _module(name, 16, torch.float16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(ROW_SLOTS), slots.a.shape[2], generator=gen).half()
    y = torch.randn(len(ROW_SLOTS), slots.b.shape[2], generator=gen).half()
    rows = LoRARows(torch.tensor(ROW_SLOTS, dtype=torch.int32), SCALING)
    got = rows.add(x, slots.weights, y.clone())
    torch.testing.assert_close(got.double(), _reference(x, y, slots), rtol=1e-2, atol=1e-2)
    base = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    assert torch.equal(got[base], y[base])


def test_a_slot_outside_the_slots_is_refused():
    slots = _module("o_proj", 8, torch.float32)
    x, y = torch.zeros(2, 64), torch.zeros(2, 64)
    with pytest.raises(IndexError, match="outside the 4 slots"):
        lora_bgmv(x, slots.a, slots.b, torch.tensor([0, 4], dtype=torch.int32), SCALING, slots.columns, y)


def _fill(lora: LoRASlots) -> None:
    """Seeded adapters in every slot of every module (slot s scaled by s + 1)."""
    gen = torch.Generator().manual_seed(0)
    for module in lora.modules.values():
        n_in = module.a.shape[2]
        for slot in range(lora.max_loras):
            for shard, (_, _, width) in module.places.items():
                a = torch.randn(module.rank, n_in, generator=gen) / n_in**0.5
                module.put(slot, shard, a, torch.randn(width, module.rank, generator=gen))
            lora.scaling[slot] = slot + 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,overrides",
    [("llama", {}), ("phi3", {"partial_rotary_factor": 0.75})],  # Phi-3: one block over fused qkv
)
def test_adapter_decode_steps_run_in_the_stack_bit_for_bit(tmp_path, dtype, arch, overrides):
    """Decode steps of rows of two adapters and the base model run in the C stack, whose
    hidden states are the program's; the base row's are the base model's."""
    path = make_checkpoint(tmp_path, arch, **overrides)
    stacked, plain, base = (load_model(path, dtype=dtype, linear_kernel="tiled") for _ in range(3))
    for model in (stacked, plain):
        model.lora = LoRASlots(model, 3, 8)
        _fill(model.lora)
    stacked.step_program = StepProgram.of(stacked)
    plain.step_program = dataclasses.replace(StepProgram.of(plain), stack=None, lora_stack=None)
    taken: list[bool] = []
    stack, run = stacked.step_program.lora_stack, stacked.step_program.lora_stack.run
    stack.run = lambda *args: taken.append((hidden := run(*args)) is not None) or hidden
    batches = [PagedBatch(model, 24, 3) for model in (stacked, plain, base)]
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    for step in [prompts] + [[[20 + i], [30 + i], [40 + i]] for i in range(6)]:
        row_slots = [slot for slot, tokens in zip((2, -1, 0), step, strict=True) for _ in tokens]
        lora = stacked.lora.rows(row_slots, None)
        got, cu = batches[0].forward(step, lora=lora)
        want, _ = batches[1].forward(step, lora=lora)
        plain_base, _ = batches[2].forward(step)
        assert torch.equal(got, want)
        assert torch.equal(got[cu[1] : cu[2]], plain_base[cu[1] : cu[2]])  # the base row
        assert not torch.equal(got[: cu[1]], plain_base[: cu[1]])  # an adapter's row
    assert taken == [False] + [True] * 6  # the prompt step runs the program, every decode the stack
