"""Each typed part of the engine's settings refuses a bad option where it is made, naming the
option; the flat EngineConfig refuses at construction through them, before anything loads; and
a resolved config holds each value once, in its part."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from pagedkv.config import CacheConfig, ParallelConfig, TierConfig
from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core.kv_policy import CONTIGUOUS, PAGED

#: The parts of the default options, each test changing one field (``replace`` makes the part anew).
DEFAULTS = EngineConfig().resolve()


def _part(name: str, **changes):
    """The default options' part ``name`` with ``changes``: made anew, so checked anew."""
    return dataclasses.replace(getattr(DEFAULTS, name), **changes)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: _part("model", dtype="float64"), "unsupported dtype 'float64'"),
        (lambda: _part("model", load_format="npz"), "unknown load_format 'npz'"),
        (lambda: _part("model", linear_kernel="mkl"), "unknown linear kernel 'mkl'"),
        (lambda: _part("model", quantization="q3_k"), "unknown quantization 'q3_k'"),
        (
            lambda: _part("model", quantized_activations="int4"),
            "unknown quantized_activations 'int4'",
        ),
        (lambda: _part("model", max_model_len=0), "max_model_len must be a positive integer, got 0"),
        (lambda: _part("cache", block_size=0), "block_size must be a positive integer, got 0"),
        (lambda: _part("cache", kv_cache_dtype="e5m2"), "unknown kv_cache_dtype 'e5m2'"),
        (lambda: _part("cache", num_kv_blocks=-1), "num_kv_blocks must be a positive integer"),
        (lambda: _part("cache", pool_bytes=0), "kv_cache_memory must be a positive integer"),
        (lambda: _part("cache", watermark=1.0), "watermark must be in [0, 1)"),
        (lambda: _part("scheduler", max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
        (lambda: _part("scheduler", max_num_batched_tokens=2.5), "max_num_batched_tokens must be a positive"),
        (lambda: _part("scheduler", decode_headroom=1.5), "decode_headroom must be in [0, 1], got 1.5"),
        (lambda: _part("scheduler", scheduling_policy="lifo"), "scheduling_policy must be one of"),
        (lambda: _part("scheduler", min_priority=1), "min_priority <= 0 <= max_priority"),
        (lambda: _part("scheduler", max_running_share=0.0), "max_running_share must be in (0, 1]"),
        (
            lambda: _part("parallel", tensor_parallel_size=0),
            "tensor_parallel_size must be a positive integer",
        ),
        (
            lambda: _part("parallel", tensor_parallel_size=4, nnodes=3, master_addr="h"),
            "cannot be split over 3 nodes",
        ),
        (
            lambda: _part("parallel", tensor_parallel_size=4, nnodes=2, node_rank=2, master_addr="h"),
            "node_rank must be in 0 .. 1",
        ),
        (
            lambda: _part("parallel", tensor_parallel_size=4, nnodes=2, node_rank=1),
            "--master-addr is required",
        ),
        (lambda: _part("parallel", distributed_timeout=0), "distributed_timeout must be positive"),
        (lambda: _part("parallel", threads_per_rank=0), "threads_per_rank must be a positive integer"),
        (lambda: _part("tier", preemption_mode="pause"), "preemption_mode must be one of"),
        (lambda: _part("tier", preemption_mode="swap"), "needs a second KV tier"),
        (lambda: _part("tier", kind="ram", capacity_bytes=2**30), "kv_offload must be one of"),
        (lambda: _part("tier", kind="host"), "needs a size: --kv-offloading-size"),
        (lambda: _part("tier", kind="host", capacity_bytes=0), "--kv-offloading-size must be positive"),
        (lambda: _part("tier", kind="disk", capacity_bytes=2**30), "needs a folder (--kv-offload-dir)"),
        (
            lambda: _part("tier", kind="host", capacity_bytes=2**30, folder=Path("/tmp")),
            "--kv-offload-dir is the disk tier's folder",
        ),
    ],
)
def test_each_part_refuses_a_bad_option_naming_it(make, message):
    with pytest.raises(ValueError) as refused:
        make()
    assert message in str(refused.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"kv_cache_memory": "plenty"}, "plenty"),
        ({"kv_cache_memory": "0"}, "kv_cache_memory must be positive or 'auto'"),
        ({"max_num_seqs": -1}, "max_num_seqs must be a positive integer"),
        ({"kv_offload": "disk", "kv_offload_memory": "1GiB"}, "needs a folder"),
        ({"tensor_parallel_size": 3, "nnodes": 2, "master_addr": "h"}, "cannot be split over 2 nodes"),
        ({"kv_policy": "virtual"}, "kv_policy must be one of"),
        ({"speculative_config": {"method": "ngram"}}, "speculative_config.num_speculative_tokens"),
        (
            {
                "kv_offload": "disk",
                "kv_offload_memory": "1GiB",
                "kv_offload_dir": "/tmp",
                "tensor_parallel_size": 2,
            },
            "the disk KV tier runs on one rank",
        ),
    ],
)
def test_the_flat_options_are_refused_when_made(options, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**options)
    assert message in str(refused.value)


def test_resolving_puts_each_value_in_its_part():
    config = EngineConfig(
        block_size=8,
        kv_cache_memory="256MiB",
        kv_cache_dtype="int8",
        max_num_seqs=7,
        scheduling_policy="priority",
        tensor_parallel_size=2,
        kv_offload="host",
        kv_offload_memory="1GiB",
        preemption_mode="swap",
        max_model_len=512,
        kv_policy="contiguous",
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}',
    )
    settings = config.resolve()
    assert settings.cache == CacheConfig(8, "int8", None, 256 * 2**20, True, 0.01)
    assert settings.scheduler.max_num_seqs == 7 and settings.scheduler.scheduling_policy == "priority"
    assert settings.scheduler.priority_range == (-100, 100)
    assert settings.parallel == ParallelConfig(2, 1, 0, None, None, 60.0, None)
    assert settings.tier == TierConfig("host", 2**30, None, "swap")
    assert settings.model.max_model_len == 512 and settings.model.loads_weights
    assert settings.kv_policy is CONTIGUOUS and not settings.prefix_caching  # contiguous never shares
    assert settings.speculative == SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    assert settings.limits is config.limits
    assert EngineConfig(kv_cache_memory="auto").resolve().cache.pool_bytes is None  # measured later
    assert EngineConfig().resolve().kv_policy is PAGED and EngineConfig().resolve().prefix_caching


def test_the_settings_travel_to_a_rank_whole():
    """Tensor-parallel ranks get the settings pickled: they come back equal."""
    settings = EngineConfig(tensor_parallel_size=2, kv_offload="host", kv_offload_memory="1GiB").resolve()
    assert pickle.loads(pickle.dumps(settings)) == settings
