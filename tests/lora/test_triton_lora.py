"""The Triton BGMV pair (``pagedkv.kernels.triton_lora``) on the C kernel's contract: each row
gets its own adapter's product (a float64 reference over the model's own slot layout), a base
row nothing, a row's result whatever rows are beside it. On the CPU the kernels run in Triton's
interpreter; with ``PAGEDKV_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh``) compiled, and
:meth:`LoRARows.add` routes to them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kernels import triton_lora
from pagedkv.models.lora_weights import PagedWeights, SlotWeights
from pagedkv.models.ops import LoRARows
from tests.devices import TEST_DEVICE
from tests.lora.test_lora_kernel import ROW_SLOTS, SCALING, _module, _reference
from tests.lora.test_lora_pages_forward import _both_forms

DEVICE = torch.device(TEST_DEVICE)
#: the rounding each dtype's output is compared to the reference with (one rounding to it)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize(
    ("name", "rank", "dtype"),
    [
        ("qkv_proj", 16, torch.float32),  # three blocks, each over its own columns
        ("gate_up_proj", 12, torch.bfloat16),  # two blocks, a rank that is not a power of two
        ("o_proj", 8, torch.float16),
        ("down_proj", 64, torch.float32),  # the largest rank, in four tiles of rank rows
    ],
)
def test_each_row_gets_its_own_adapter_and_a_base_row_nothing(name, rank, dtype):
    slots = _module(name, rank, dtype)
    a, b, columns = slots.a.to(DEVICE), slots.b.to(DEVICE), slots.columns.to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(ROW_SLOTS), a.shape[2], generator=gen).to(dtype)
    y = torch.randn(len(ROW_SLOTS), b.shape[2], generator=gen).to(dtype)
    row_slot = torch.tensor(ROW_SLOTS, dtype=torch.int32, device=DEVICE)
    scaling = SCALING.to(DEVICE)
    got = triton_lora.lora_bgmv(x.to(DEVICE), a, b, row_slot, scaling, columns, y.to(DEVICE, copy=True)).cpu()
    want = _reference(x, y, slots)
    assert not torch.allclose(want, y.double(), atol=0.1)  # the adapters change the rows
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[dtype], atol=1e-5)
    base = [row for row, slot in enumerate(ROW_SLOTS) if slot < 0]
    assert torch.equal(got[base], y[base])
    for row in (2, 6):  # a row's sums do not depend on the rows beside it
        alone = triton_lora.lora_bgmv(
            x[row : row + 1].to(DEVICE),
            a,
            b,
            row_slot[row : row + 1],
            scaling,
            columns,
            y[row : row + 1].to(DEVICE, copy=True),
        )
        assert torch.equal(alone.cpu()[0], got[row])


@pytest.mark.parametrize("form", ["slots", "pages"])
def test_the_lora_op_runs_the_kernel_on_cuda(form):
    """:meth:`LoRARows.add` on DEVICE, adapters in slot tensors or in their pages: on CUDA the
    Triton pair's rows bit for bit; on the CPU (float32: the C kernels) the same rows to
    rounding."""
    slots, paged = _both_forms("qkv_proj", 8, torch.float32)
    a, b, columns = slots.a.to(DEVICE), slots.b.to(DEVICE), slots.columns.to(DEVICE)
    if form == "slots":
        weights = SlotWeights(a, b, columns)
    else:
        pages = paged.weights
        weights = PagedWeights(pages.base.to(DEVICE), pages.offsets.to(DEVICE), pages.columns, pages.n_in)
    x = torch.randn(len(ROW_SLOTS), a.shape[2], device=DEVICE)
    y = torch.randn(len(ROW_SLOTS), b.shape[2], device=DEVICE)
    row_slot = torch.tensor(ROW_SLOTS, dtype=torch.int32, device=DEVICE)
    step = torch.tensor(sorted({s for s in ROW_SLOTS if s >= 0}), device=DEVICE)
    got = LoRARows(row_slot, SCALING.to(DEVICE), adapters=step).add(x, weights, y.clone())
    kernel = triton_lora.lora_bgmv(x, a, b, row_slot, SCALING.to(DEVICE), columns, y.clone())
    if DEVICE.type == "cuda":
        assert torch.equal(got, kernel)
    torch.testing.assert_close(got, kernel, rtol=1e-5, atol=1e-5)


def test_mismatched_shapes_are_refused_by_name():
    slots = _module("o_proj", 8, torch.float32)
    x, y = torch.zeros(2, 64), torch.zeros(2, 63)
    with pytest.raises(ValueError, match="LoRA shapes do not match"):
        triton_lora.lora_bgmv(
            x, slots.a, slots.b, torch.zeros(2, dtype=torch.int32), SCALING, slots.columns, y
        )
    with pytest.raises(ValueError, match="row_slot must be int32"):
        rows = torch.zeros(2, dtype=torch.int64)
        triton_lora.lora_bgmv(x, slots.a, slots.b, rows, SCALING, slots.columns, torch.zeros(2, 64))


@settings(max_examples=8, deadline=None)
@given(
    widths=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    rank=st.integers(1, 20),
    n_in=st.integers(1, 40),
    slots=st.integers(1, 3),
    data=st.data(),
)
def test_any_packing_of_blocks_gives_each_row_its_own_product(widths, rank, n_in, slots, data):
    """Any widths of packed blocks (column bounds off every tile boundary), rank and input
    width: each row's output is its own adapter's float64 product to float32 rounding, base
    rows untouched."""
    row_slots = data.draw(st.lists(st.integers(-1, slots - 1), min_size=1, max_size=5))
    gen = torch.Generator().manual_seed(len(widths) * 1000 + rank * 40 + n_in)
    shards, n_out = len(widths), sum(widths)
    columns = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()])
    a = torch.randn(slots, shards * rank, n_in, generator=gen)
    b = torch.zeros(slots, shards * rank, n_out)
    for p in range(shards):  # block p's B is zero outside its own columns
        cut = b[:, p * rank : (p + 1) * rank, columns[p] : columns[p + 1]]
        cut.copy_(torch.randn(cut.shape, generator=gen))
    x = torch.randn(len(row_slots), n_in, generator=gen)
    y = torch.randn(len(row_slots), n_out, generator=gen)
    scaling = torch.rand(slots, generator=gen) + 0.5
    row_slot = torch.tensor(row_slots, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (x, a, b, row_slot, scaling, columns)]
    got = triton_lora.lora_bgmv(*args, y.to(DEVICE, copy=True)).cpu().double()
    want = y.double()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            want[row] += scaling[slot].double() * (
                (x[row].double() @ a[slot].double().t()) @ b[slot].double()
            )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["qkv_proj", "down_proj"])
def test_paged_adapters_gathered_as_slots_give_each_row_its_own_adapter(name):
    """Adapters in their pages of the KV cache, as the Triton pair takes them on CUDA: only the
    step's adapters (slots 0 and 2; slot 3 points at stale KV, NaN) gathered into slot tensors,
    each row's slot renumbered to its adapter's place among them."""
    slots, paged = _both_forms(name, 16, torch.float32)
    paged.weights.offsets[3].fill_(0)  # the cache's first elements: NaN
    row_slots = [-1, 2, 0, 2, -1, 0]
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(len(row_slots), slots.a.shape[2], generator=gen)
    y = torch.randn(len(row_slots), slots.b.shape[2], generator=gen)
    step = torch.tensor([0, 2])
    a, b, renumbered, scales = paged.weights.slot_form(
        torch.tensor(row_slots, dtype=torch.int32), SCALING, step
    )
    assert renumbered.tolist() == [-1, 1, 0, 1, -1, 0] and a.shape[0] == 2
    args = [t.to(DEVICE) for t in (x, a, b, renumbered, scales, paged.weights.columns)]
    got = triton_lora.lora_bgmv(*args, y.to(DEVICE, copy=True)).cpu().double()
    want = y.double()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            product = (x[row].double() @ slots.a[slot].double().t()) @ slots.b[slot].double()
            want[row] += SCALING[slot].double() * product
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
