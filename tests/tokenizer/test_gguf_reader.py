"""pagedkv's GGUF header reader against gguf-py's ``GGUFReader``, the reference: the same metadata
values, the same tensors with the same data, on a file of every value type and on the real
model's file; and a vocabulary costs no Python object per entry until it is asked for."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from pagedkv.models.gguf_config import gguf_config
from pagedkv.tokenizer.gguf_file import GGUFError, open_gguf
from pagedkv.tokenizer.gguf_reader import GGUFFile
from tests.real_model import gguf_path

Q = GGMLQuantizationType


def reference_values(reader: GGUFReader) -> dict:
    """Every metadata value as gguf-py reads it (float32 scalars as their shortest decimal,
    as pagedkv reads them)."""
    values = {}
    for key, entry in reader.fields.items():
        if key.startswith("GGUF."):  # the header's own counts, not metadata
            continue
        value = entry.contents()
        if entry.types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        values[key] = value
    return values


def assert_reads_as_gguf(path) -> None:
    reference, ours = GGUFReader(path, "c"), GGUFFile(path)
    expected = reference_values(reference)
    assert list(ours.fields) == list(expected)
    for key, value in expected.items():
        assert ours.value(key) == value and type(ours.value(key)) is type(value), key
    assert len(ours.tensors) == len(reference.tensors)
    for theirs, mine in zip(reference.tensors, ours.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.name,
            theirs.tensor_type,
            theirs.n_elements,
            theirs.n_bytes,
            theirs.data_offset,
        )
        assert mine.shape.tolist() == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data.view(np.uint8), theirs.data.view(np.uint8)), mine.name


def test_every_value_type_and_tensor_type_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "all.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.true", True)
    writer.add_bool("t.false", False)
    writer.add_string("t.text", "héllo ▁wörld")
    writer.add_array("t.strings", ["a", "", "ĠHello", "<|im_end|>"])
    writer.add_array("t.ints", [1, 3, 4, 1])
    writer.add_array("t.floats", [0.5, -1.25, 3.0])
    writer.add_array("t.bools", [True, False, True])
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("f32", weight)
    writer.add_tensor("f16", weight.astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for qtype in (Q.Q8_0, Q.Q4_1, Q.BF16):
        writer.add_tensor(qtype.name, quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf(path)
    assert GGUFFile(path).value("t.strings") == ["a", "", "ĠHello", "<|im_end|>"]


def test_the_real_models_file_reads_as_gguf_reads_it():
    assert_reads_as_gguf(gguf_path())


def test_a_vocabulary_is_not_kept_as_python_objects():
    """gguf-py keeps two numpy views per token (tens of MiB for this 49,152-token vocabulary
    and its merges); the header here is a few hundred bytes per metadata key and tensor."""
    tracemalloc.start()
    try:
        reader = GGUFFile(gguf_path())
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(reader.value("tokenizer.ggml.tokens")) == 49152
    assert held < 512 * 1024, f"the open header holds {held} bytes of Python heap"


def test_an_unknown_tensor_type_is_kept_by_number_and_refused_by_name(tmp_path):
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    # the tensor's type follows its name, its dimension count and its two dimensions
    at = data.index(b"w", 24) + 1 + 4 + 16
    assert int.from_bytes(data[at : at + 4], "little") == Q.F32
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    (tensor,) = GGUFFile(path).tensors
    assert (tensor.tensor_type, tensor.data) == (99, None)
    with pytest.raises(GGUFError, match=r"tensor w has type type 99, which pagedkv cannot read"):
        gguf_config([path])


@pytest.mark.parametrize("version", [1, 4])
def test_a_version_it_cannot_read_is_named(tmp_path, version):
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + version.to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFError, match=rf"GGUF version pagedkv cannot read \({version};"):
        open_gguf(path)
