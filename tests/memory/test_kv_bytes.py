import dataclasses

import pytest

from pagedkv.memory import GPT_STYLE_7B, KVSpec, parse_bytes


def test_seed_model_is_512_kib_per_token():
    assert GPT_STYLE_7B.bytes_per_token == 524_288
    assert GPT_STYLE_7B.bytes_per_block(16) == 16 * 524_288


def test_gqa_and_dtype_scale_bytes():
    spec = KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    assert spec.bytes_per_token == 2 * 2 * 4 * 64 * 4
    assert spec.blocks_in(spec.bytes_per_block(16) * 10 + 5, 16) == 10


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
def test_invalid_shape_names_the_field(field):
    kwargs = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        KVSpec(**kwargs)


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        KVSpec(1, 1, 1, dtype="float64")


@pytest.mark.parametrize(
    "text,expected",
    [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("80GB", 80 * 10**9), ("1000", 1000), (7, 7)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes("lots")


def test_quantized_dtypes_count_their_scales():
    """The seeds' 7B shape: 512 KiB per token in fp16; one byte per element plus a float32 scale
    per token, layer, KV head and key/value in fp8 or int8 (256 KiB + 8 KiB)."""
    assert GPT_STYLE_7B.bytes_per_token == 512 * 1024
    for name in ("float8", "int8"):
        spec = dataclasses.replace(GPT_STYLE_7B, dtype=name)
        assert spec.scale_bytes == 4
        assert spec.bytes_per_token == 256 * 1024 + 2 * 32 * 32 * 4
