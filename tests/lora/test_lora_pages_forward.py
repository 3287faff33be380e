"""The forward pass reading LoRA adapters where they live, in their pages of the KV cache: the
paged kernel equals the slot kernel bit for bit (every target module, ranks 8, 16, 64 and a
zero-padded rank), reads no row outside the step's adapters' own, and the torch form off the
kernel gives the same rows; a model's paged adapters give the slot tensors' hidden states and
its C decode stack the program's, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.attention.adapter_slabs import cache_chunk_elements, row_offsets, write_adapter
from pagedkv.attention.kv_cache import KVCache
from pagedkv.kernels.lora_bgmv import lora_bgmv, lora_bgmv_paged
from pagedkv.memory.adapter_layout import AdapterLayout, chunk_elements
from pagedkv.memory.kv_bytes import KVSpec
from pagedkv.models import load_model
from pagedkv.models.lora import LoRASlots, ModuleSlots
from pagedkv.models.lora_checkpoint import TARGETS, model_targets, projection_shapes
from pagedkv.models.lora_paged import ModuleRows, PagedLoRA
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
#: three adapters (five rows of slot 2: a group of four and one more), base rows between them;
#: slot 3 is pointed at no adapter and never used
ROW_SLOTS = [-1, 0, 2, 1, 0, -1, 2, 2, 1, 2, 2]
SCALING = torch.tensor([2.0, 0.5, 1.25, 3.0])
#: the pages' cache: 2 KV heads of 16, blocks of 4 tokens -- chunks of 128 elements, so a row of
#: 96 leaves a gap at each chunk's end
SPEC, BLOCK = KVSpec(1, 2, 16), 4


def _both_forms(name: str, rank: int, dtype: torch.dtype) -> tuple[ModuleSlots, ModuleRows]:
    """The same three adapters of module ``name`` (slots 0 and 2 of ``rank``, slot 1 of half
    the rank, zero-padded) as slot tensors and as rows in pages of a KV cache whose every other
    element is NaN (stale KV a stray read would show)."""
    n_in, widths = MODULES[name]
    shapes = {shard: (n_in, width) for shard, width in widths.items()}
    slots = ModuleSlots(shapes, tuple(widths), 4, rank, torch.empty(0, dtype=dtype))
    gen = torch.Generator().manual_seed(rank)
    adapters = []
    for slot, r in ((0, rank), (1, rank // 2), (2, rank)):
        weights = {}
        for shard, width in widths.items():
            a = (torch.randn(r, n_in, generator=gen) / n_in**0.5).to(dtype)
            b = (torch.randn(width, r, generator=gen) / r**0.5).to(dtype)
            slots.put(slot, shard, a, b)
            weights[shard] = (a, b)
        adapters.append((slot, weights))
    chunk = chunk_elements(BLOCK, SPEC.num_kv_heads, SPEC.head_dim)
    pages = [
        AdapterLayout.of([{t: (a.shape, b.shape) for t, (a, b) in w.items()}], chunk).pages
        for _, w in adapters
    ]
    cache = KVCache(SPEC, sum(pages) + 5, BLOCK, dtype=dtype)
    cache.data.fill_(float("nan"))
    rows = ModuleRows(shapes, tuple(widths), 4, rank, cache.data.view(-1))
    free = torch.randperm(cache.num_blocks, generator=gen).tolist()  # pages scattered in the cache
    for (slot, weights), count in zip(adapters, pages, strict=True):
        block_ids, free = free[:count], free[count:]
        layout = write_adapter(cache, block_ids, [weights])
        for shard, (a_rows, b_rows) in row_offsets(cache, block_ids, layout)[0].items():
            rows.point(slot, shard, a_rows, b_rows)
    return slots, rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("name", list(MODULES))
def test_the_paged_kernel_gives_the_slot_kernel_s_bits(name, rank, dtype):
    slots, paged = _both_forms(name, rank, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(ROW_SLOTS), slots.a.shape[2], generator=gen).to(dtype)
    y = torch.randn(len(ROW_SLOTS), slots.b.shape[2], generator=gen).to(dtype)
    row_slot = torch.tensor(ROW_SLOTS, dtype=torch.int32)
    want = lora_bgmv(x, slots.a, slots.b, row_slot, SCALING, slots.columns, y.clone())
    weights = paged.weights
    got = lora_bgmv_paged(x, weights.base, weights.offsets, row_slot, SCALING, weights.columns, y.clone())
    assert not torch.equal(want, y) and torch.equal(got, want)
    for row in range(len(ROW_SLOTS)):  # alone, as in the batch
        alone = lora_bgmv_paged(
            x[row : row + 1],
            weights.base,
            weights.offsets,
            row_slot[row : row + 1],
            SCALING,
            weights.columns,
            y[row : row + 1].clone(),
        )
        assert torch.equal(alone[0], want[row])


def test_a_smaller_rank_s_padding_is_no_row_in_the_pages():
    _, paged = _both_forms("qkv_proj", 16, torch.float32)
    offsets = paged.weights.offsets
    assert (offsets[1, :, :8] >= 0).all() and (offsets[1, :, 8:16] == -1).all()  # q's block of slot 1
    assert (offsets[3] == -1).all()  # an empty slot


@pytest.mark.parametrize("name", list(MODULES))
def test_the_torch_form_gathers_only_the_step_s_adapters(name):
    """Off the kernel (float16 here, CUDA in the engine) the step's adapters' rows are gathered
    and multiplied densely; slot 3, pointed at stale KV (NaN), is not one of them."""
    slots, paged = _both_forms(name, 16, torch.float16)
    paged.weights.offsets[3].fill_(0)  # the cache's first elements: NaN
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(ROW_SLOTS), slots.a.shape[2], generator=gen).half()
    y = torch.randn(len(ROW_SLOTS), slots.b.shape[2], generator=gen).half()
    used = torch.tensor(sorted({s for s in ROW_SLOTS if s >= 0}))
    rows = LoRARows(torch.tensor(ROW_SLOTS, dtype=torch.int32), SCALING, adapters=used)
    got = rows.add(x, paged.weights, y.clone())
    want = rows.add(x, slots.weights, y.clone())
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    base = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    assert torch.equal(got[base], y[base])


def _adapters(model, count: int, rank: int) -> list[list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
    """``count`` seeded adapters of every target of every layer of ``model``."""
    gen = torch.Generator().manual_seed(0)
    dtype = model.model.norm.weight.dtype
    shapes = {t: projection_shapes(model.config)[t] for t in model_targets(model.config)}
    return [
        [
            {
                t: (
                    torch.randn(rank, n_in, generator=gen).to(dtype) / n_in**0.5,
                    torch.randn(n_out, rank, generator=gen).to(dtype),
                )
                for t, (n_in, n_out) in shapes.items()
            }
            for _ in range(model.config.num_layers)
        ]
        for _ in range(count)
    ]


def _into_slots(lora: LoRASlots, adapters) -> None:
    for slot, layers in enumerate(adapters):
        for layer, targets in enumerate(layers):
            for shard, (a, b) in targets.items():
                lora.modules[layer, TARGETS[shard]].put(slot, shard, a, b)
        lora.scaling[slot] = slot + 1.0


def _into_pages(lora: PagedLoRA, cache: KVCache, adapters) -> None:
    first = 0
    for slot, layers in enumerate(adapters):
        shapes = [{t: (a.shape, b.shape) for t, (a, b) in layer.items()} for layer in layers]
        pages = AdapterLayout.of(shapes, cache_chunk_elements(cache)).pages
        block_ids = list(range(first + pages - 1, first - 1, -1))  # in reverse: pages in any order
        layout = write_adapter(cache, block_ids, layers)
        lora.point(slot, row_offsets(cache, block_ids, layout), slot + 1.0)
        first += pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_adapters_give_the_slots_hidden_states_in_the_stack_and_the_program(tmp_path, dtype):
    """Decode steps of two adapters and the base model: with the adapters in pages (no slot
    tensors), the C stack's hidden states equal the program's and the slot tensors', bit for bit."""
    path = make_checkpoint(tmp_path, "llama")
    paged, plain, slotted = (load_model(path, dtype=dtype, linear_kernel="tiled") for _ in range(3))
    adapters = _adapters(paged, 3, 8)
    pages = KVCache(paged.config.kv_spec(), 60, 16, dtype=dtype)
    pages.data.fill_(float("nan"))
    for model in (paged, plain):
        model.lora = PagedLoRA(model, 3, 8, pages.data)
        _into_pages(model.lora, pages, adapters)
    slotted.lora = LoRASlots(slotted, 3, 8)
    _into_slots(slotted.lora, adapters)
    assert not any(isinstance(m, ModuleSlots) for m in paged.lora.modules.values())
    for model in (paged, slotted):
        model.step_program = StepProgram.of(model)
    plain.step_program = dataclasses.replace(StepProgram.of(plain), stack=None, lora_stack=None)
    taken: list[bool] = []
    stack, run = paged.step_program.lora_stack, paged.step_program.lora_stack.run
    stack.run = lambda *args: taken.append((hidden := run(*args)) is not None) or hidden
    batches = [PagedBatch(model, 24, 3) for model in (paged, plain, slotted)]
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    for step in [prompts] + [[[20 + i], [30 + i], [40 + i]] for i in range(4)]:
        row_slots = [slot for slot, tokens in zip((2, -1, 0), step, strict=True) for _ in tokens]
        lora = paged.lora.rows(row_slots, None)
        got, cu = batches[0].forward(step, lora=lora)
        program, _ = batches[1].forward(step, lora=lora)
        slots, _ = batches[2].forward(step, lora=slotted.lora.rows(row_slots, None))
        assert not got.isnan().any() and torch.equal(got, program) and torch.equal(got, slots)
    assert taken == [False] + [True] * 4  # the prompt step runs the program, every decode the stack


def test_a_slot_not_pointed_at_its_pages_is_refused(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    model = load_model(path, dtype=torch.float32)
    pages = KVCache(model.config.kv_spec(), 8, 16)
    model.lora = PagedLoRA(model, 2, 8, pages.data)
    with pytest.raises(RuntimeError, match=r"LoRA slots \[1\] are not pointed"):
        model.lora.rows([-1, 1], None)
    assert model.lora.rows([-1, -1], None) is None
