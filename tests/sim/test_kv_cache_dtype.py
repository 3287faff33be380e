"""The simulator sizes its KV memory with the stored element type (``--kv-cache-dtype``)."""

import pytest

from pagedkv.cli import build_parser
from pagedkv.sim import SimConfig


def test_fp8_nearly_doubles_the_token_slots():
    auto, fp8 = SimConfig(), SimConfig(kv_cache_dtype="fp8")
    assert auto.stored_kv_spec.bytes_per_token == 512 * 1024
    assert fp8.stored_kv_spec.bytes_per_token == 264 * 1024  # 256 KiB of elements + 8 KiB of scales
    assert fp8.kv_slots == auto.kv_memory // (264 * 1024) and fp8.kv_slots > 1.9 * auto.kv_slots


def test_the_option_is_parsed_and_checked():
    args = build_parser().parse_args(["simulate", "--kv-cache-dtype", "int8"])
    assert args.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        SimConfig(kv_cache_dtype="fp4")
