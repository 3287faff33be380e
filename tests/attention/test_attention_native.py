"""The C paged-attention kernel through the ``cpu`` backend, and the fallbacks around it (its
build and cache: tests/kernels)."""

from __future__ import annotations

import pytest
import torch

from pagedkv.attention import (
    AttentionMetadata,
    AttentionOptions,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedkv.attention.backends import cpu, cpu_rows
from pagedkv.kernels import paged_attention
from tests.kernels.no_compiler import run_without_compiler

from .cases import contiguous_attention, make_case

WITHOUT_COMPILER = """
import warnings
import torch
from pagedkv.attention import paged_decode_attention, paged_prefill_attention
from tests.attention.cases import contiguous_attention, make_case

case = make_case([3, 20], 8, 2, 16, device="cpu")
q = torch.randn(2, 4, 16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = paged_decode_attention(q, case.layer, case.block_tables, case.context_lens, 0.25, backend="cpu")
    expected = torch.stack(
        [contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.25)[0] for b in range(2)]
    )
    torch.testing.assert_close(out, expected)
    q = torch.randn(23, 4, 16)  # prefill rows also fall back
    cu = torch.tensor([0, 3, 23], dtype=torch.int32)
    args = (q, case.layer, case.block_tables, cu, case.context_lens, 0.25)
    out = paged_prefill_attention(*args, backend="cpu")
    torch.testing.assert_close(out[3:], contiguous_attention(q[3:], case.keys[1], case.values[1], 0.25))
messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
assert len(messages) == 1 and "no C compiler found" in messages[0], messages  # warned once
"""


def test_without_a_compiler_the_cpu_backend_warns_once_and_stays_correct(tmp_path):
    run_without_compiler(WITHOUT_COMPILER, tmp_path)


def test_more_query_heads_per_kv_head_than_the_kernel_holds():
    group = paged_attention.MAX_GROUP * 2
    case = make_case([9, 33], 16, 1, 16, device="cpu")
    q = torch.randn(2, group, 16)
    out = paged_decode_attention(q, case.layer, case.block_tables, case.context_lens, 0.25, backend="cpu")
    expected = torch.stack(
        [contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.25)[0] for b in range(2)]
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_every_group_size_the_kernel_holds_attends_as_the_reference(group):
    """Each count of query heads per KV head up to what the kernel keeps in registers (3: SmolLM2,
    Llama 3.2 3B) has its own compiled loop in both passes; head dimension 64 takes the value
    pass's whole groups of vectors."""
    case = make_case([9, 40, 130], 16, 2, 64, seed=group, device="cpu")
    q = torch.randn(3, 2 * group, 64)
    out = paged_decode_attention(q, case.layer, case.block_tables, case.context_lens, 0.125, backend="cpu")
    expected = torch.stack(
        [contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.125)[0] for b in range(3)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_long_rows_split_into_pieces_merge_exactly():
    """A single long sequence is split across threads (flash-decoding); the merge is exact."""
    case = make_case([cpu_rows.MAX_CHUNK * 2 + 5], 16, 2, 64, seed=7, device="cpu")
    q = torch.randn(1, 8, 64)
    out = paged_decode_attention(q, case.layer, case.block_tables, case.context_lens, 0.125, backend="cpu")
    torch.testing.assert_close(
        out, contiguous_attention(q, case.keys[0], case.values[0], 0.125), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("block_size", [16, 12, 1])
def test_any_block_size_finds_its_slots(block_size):
    """Block sizes that are powers of two take shifts and masks to find a position's slot, the
    others divisions: both must read the same keys as the contiguous reference."""
    case = make_case([1, block_size - 1 or 1, block_size + 1, 50], block_size, 2, 32, seed=3, device="cpu")
    q = torch.randn(4, 4, 32)
    out = paged_decode_attention(q, case.layer, case.block_tables, case.context_lens, 0.2, backend="cpu")
    expected = torch.stack(
        [contiguous_attention(q[b : b + 1], case.keys[b], case.values[b], 0.2)[0] for b in range(4)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_cpu_backend_refuses_tensors_off_the_cpu():
    case = make_case([4], 4, 1, 16, device="cpu")
    with pytest.raises(ValueError, match="needs CPU tensors"):
        cpu.attend_rows(
            torch.randn(1, 1, 16, device="meta"),
            case.layer,
            case.block_tables,
            torch.zeros(1),
            torch.zeros(1),
            AttentionOptions(1.0),
        )


def _row_kernel(q, case, row_seq, row_pos, chunk, window=0, soft_cap=0.0):
    """The row kernel called directly, with the split ``chunk`` (one thread)."""
    layer = case.layer
    kernel = paged_attention.load().rows_fn(q.dtype, layer.key.dtype)
    rows = cpu_rows.KernelRows.of(case.block_tables, torch.tensor(row_seq), torch.tensor(row_pos))
    scales = (layer.key_scale.data_ptr(), layer.value_scale.data_ptr()) if layer.quantized else (None, None)
    out, q = torch.empty_like(q), q.contiguous()
    heads, head_dim = q.shape[1:]
    status = kernel(
        q.data_ptr(),
        layer.key.data_ptr(),
        layer.value.data_ptr(),
        *scales,
        rows.tables.data_ptr(),
        rows.row_seq.data_ptr(),
        rows.row_pos.data_ptr(),
        out.data_ptr(),
        len(row_seq),
        heads,
        layer.num_kv_heads,
        head_dim,
        layer.block_size,
        rows.tables.shape[1],
        head_dim**-0.5,
        window,
        soft_cap,
        chunk,
        1,
    )
    assert status == 0
    return out


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"), [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8")]
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "chunk"),
    [(4, 2, 32, 64), (8, 2, 16, 20), (16, 1, 16, 2048), (4, 4, 24, 64)],
)
def test_runs_of_rows_attend_causally_within_them(dtype, kv_cache_dtype, heads, kv_heads, head_dim, chunk):
    """Consecutive rows of one sequence -- speculative decoding's k + 1 rows -- are computed
    together, lanes across their query heads (where the head shape allows it; else row by row),
    each row attending its context up to its own position: a run of 16, of 9 (two lane tiles
    at 8 rows a tile), of 2, and a lone row beside them, over contexts split into pieces."""
    case = make_case(
        [150, 40, 30],
        16,
        kv_heads,
        head_dim,
        dtype=dtype,
        seed=13,
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )
    runs = [(0, range(134, 150)), (1, range(31, 40)), (2, [10]), (2, range(28, 30))]
    row_seq = [b for b, positions in runs for _ in positions]
    row_pos = [p for _, positions in runs for p in positions]
    q = torch.randn(len(row_seq), heads, head_dim).to(dtype)
    out = _row_kernel(q, case, row_seq, row_pos, chunk)
    exact = dtype == torch.float32 and kv_cache_dtype == "auto"
    for r, (b, position) in enumerate(zip(row_seq, row_pos, strict=True)):
        keys, values = case.keys[b][: position + 1], case.values[b][: position + 1]
        expected = contiguous_attention(q[r : r + 1].float(), keys, values, head_dim**-0.5)[0]
        tolerance = 1e-5 if exact else 5e-2
        torch.testing.assert_close(out[r].float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(out, _row_kernel(q, case, row_seq, row_pos, chunk))  # deterministic
    lone = _row_kernel(q[-3:-2], case, row_seq[-3:-2], row_pos[-3:-2], chunk)
    assert torch.equal(out[-3], lone[0])  # a lone row is its own computation, whatever is beside it


@pytest.mark.parametrize(("window", "soft_cap"), [(0, 30.0), (7, 0.0)])
def test_runs_with_a_soft_cap_or_a_window_attend_as_the_reference(window, soft_cap):
    """A soft cap is applied lane by lane; a window's rows never run together (each row's first
    position differs), so they are computed row by row."""
    case = make_case([60], 16, 2, 32, seed=17, device="cpu")
    row_pos = list(range(52, 60))
    q = torch.randn(len(row_pos), 4, 32) * 4  # large scores: the cap bites
    out = _row_kernel(q, case, [0] * len(row_pos), row_pos, 64, window, soft_cap)
    for r, position in enumerate(row_pos):
        keys, values = case.keys[0][: position + 1], case.values[0][: position + 1]
        expected = contiguous_attention(
            q[r : r + 1], keys, values, 32**-0.5, window or None, soft_cap or None
        )[0]
        torch.testing.assert_close(out[r], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_long_prefill_runs_take_the_sdpa_path(monkeypatch, window):
    """Above NATIVE_MAX_QUERY_LEN new tokens a sequence the tile kernel cannot take (a window) is
    gathered and handed to SDPA (with a cached prefix: a bottom-right-aligned mask); without a
    window the same runs are tiled. Shorter ones in the same step take the row kernel."""
    monkeypatch.setattr(cpu, "NATIVE_MAX_QUERY_LEN", 8)
    case = make_case([30, 12, 4], 4, 2, 32, seed=5, device="cpu")
    q_lens = [20, 12, 2]  # prefix hit + SDPA, whole prompt + SDPA (is_causal), kernel
    q = torch.randn(sum(q_lens), 8, 32)
    cu = torch.tensor([0, 20, 32, 34], dtype=torch.int32)
    out = paged_prefill_attention(
        q, case.layer, case.block_tables, cu, case.context_lens, 0.2, window, backend="cpu"
    )
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = contiguous_attention(q[rows], case.keys[b], case.values[b], 0.2, window)
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)


# -- prefill tiles ------------------------------------------------------------------------------
TILE_SHAPES = [(4, 4, 16), (8, 4, 64), (8, 2, 32), (16, 2, 128), (8, 1, 16)]  # heads, KV heads, dim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), TILE_SHAPES)
def test_prefill_tiles_match_the_reference(dtype, heads, kv_heads, head_dim):
    """Runs of at least a tile's rows take the tile kernel -- a whole prompt, one continuing
    after a cached prefix, one ending in a partial tile -- next to a decode row and a short run
    on the row kernel in the same step. Unused slots hold NaN: nothing past a row is read."""
    context_lens, q_lens = [40, 57, 35, 9, 3], [40, 20, 35, 1, 3]
    case = make_case(context_lens, 16, kv_heads, head_dim, dtype=dtype, seed=11, device="cpu")
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype)
    options = AttentionOptions(head_dim**-0.5)
    rows_per_tile = cpu.tile_rows(q, case.layer, options)
    assert (
        0 < rows_per_tile <= 16 and rows_per_tile * heads // kv_heads == paged_attention.load().prefill_lanes
    )
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, case.layer, case.block_tables, cu, case.context_lens, options.scale)
    out = paged_prefill_attention(*args, backend="cpu")
    expected = paged_prefill_attention(*args, backend="torch")
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, expected, **tolerance)
    if dtype == torch.float32:  # and the reference itself is right
        for b in range(len(q_lens)):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            truth = contiguous_attention(q[rows], case.keys[b], case.values[b], options.scale)
            torch.testing.assert_close(out[rows], truth, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "options"),
    [
        (8, 4, 8, AttentionOptions(0.3)),  # a head dimension the tiles do not take
        (6, 2, 16, AttentionOptions(0.3)),  # a group of 3 does not divide the lanes
        (4, 2, 16, AttentionOptions(0.3, sliding_window=6)),
        (4, 2, 16, AttentionOptions(0.3, soft_cap=5.0)),
    ],
)
def test_what_the_tiles_cannot_take_keeps_the_row_kernel(heads, kv_heads, head_dim, options):
    case = make_case([30, 12], 16, kv_heads, head_dim, seed=4, device="cpu")
    q = torch.randn(42, heads, head_dim)
    assert cpu.tile_rows(q, case.layer, options) == 0
    cu = torch.tensor([0, 30, 42], dtype=torch.int32)
    window, cap = options.sliding_window, options.soft_cap
    args = (q, case.layer, case.block_tables, cu, case.context_lens, options.scale, window)
    out = paged_prefill_attention(*args, soft_cap=cap, backend="cpu")
    torch.testing.assert_close(
        out, paged_prefill_attention(*args, soft_cap=cap, backend="torch"), atol=1e-5, rtol=1e-5
    )


def test_a_recomputed_sequence_attends_its_generated_tokens_as_decodes_did():
    """After a preemption a sequence computes its prompt and its generated tokens again in one
    run. With the prompt lengths known, the prompt rows take the tiles (as when the prompt was
    first computed) and the generated rows the row kernel (as their decodes): bit for bit the
    first computation, so the sequence's next tokens do not change."""
    prompt_len, total = 12, 40
    case = make_case([total], 16, 2, 32, seed=9, device="cpu")
    q = torch.randn(total, 4, 32)
    options = AttentionOptions(0.2)
    first = paged_prefill_attention(
        q[:prompt_len], case.layer, case.block_tables, torch.tensor([0, prompt_len], dtype=torch.int32),
        torch.tensor([prompt_len], dtype=torch.int32), options.scale, backend="cpu",
    )  # fmt: skip
    decodes = [
        paged_decode_attention(
            q[p : p + 1],
            case.layer,
            case.block_tables,
            torch.tensor([p + 1], dtype=torch.int32),
            0.2,
            backend="cpu",
        )
        for p in range(prompt_len, total)
    ]
    metadata = AttentionMetadata.for_attention_only(
        case.block_tables, case.context_lens, torch.tensor([0, total], dtype=torch.int32)
    )
    metadata.prompt_lens = torch.tensor([prompt_len], dtype=torch.int32)
    again = cpu.prefill(q, case.layer, metadata, options)
    assert cpu.tile_rows(q, case.layer, options) > 0
    assert torch.equal(again[:prompt_len], first)
    assert torch.equal(again[prompt_len:], torch.cat(decodes))


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 12])
def test_bfloat16_rows_attend_as_float32_over_the_same_numbers(head_dim, block_size):
    """bfloat16 queries over a bfloat16 pool, three query heads per KV head (SmolLM2's shape at
    head dimension 64). With AVX512-BF16 and a head dimension that is a multiple of 32 the scores
    are pair dot products and the value sums hold each chunk's even and odd elements apart until
    the piece ends; every product is exact either way, so a row agrees with float32 attention
    over the same bfloat16 numbers to the output's rounding: pieces that cut blocks (chunk 20),
    contexts ending inside a block and shorter than one pass-1 step."""
    lens = [1, 17, 45, 131]
    case = make_case(lens, block_size, 3, head_dim, dtype=torch.bfloat16, seed=head_dim, device="cpu")
    q = torch.randn(len(lens), 9, head_dim).to(torch.bfloat16)
    out = _row_kernel(q, case, list(range(len(lens))), [n - 1 for n in lens], chunk=20)
    for b in range(len(lens)):
        keys, values = case.keys[b].float(), case.values[b].float()
        expected = contiguous_attention(q[b : b + 1].float(), keys, values, head_dim**-0.5)[0]
        torch.testing.assert_close(out[b].float(), expected, atol=2e-3, rtol=2**-7)
