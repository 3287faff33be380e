"""Sharding rules of tensor parallelism that need no second process: which heads, rows and
vocabulary slice each rank holds, what cannot be split (a clear error naming the numbers), and
how ranks find each other (pagedkv's options, torchrun's environment)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedkv import LLM
from pagedkv.distributed import Rendezvous
from pagedkv.engine.config import EngineConfig
from pagedkv.models import ModelConfig
from pagedkv.models.parallel import TensorParallel, TensorSlice
from pagedkv.models.shard_config import check_divisible, shard_config
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> ModelConfig:
    return ModelConfig.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("tp-rules"), "llama"))


def test_a_model_that_cannot_be_split_is_refused_naming_the_numbers(config, tmp_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 .*4 attention heads.*not divisible by 3"):
        check_divisible(config, 3)
    three_kv = dataclasses.replace(config, num_heads=12, num_kv_heads=3)
    with pytest.raises(ValueError, match=r"3 key/value heads \(fewer than the ranks, and not a divisor\)"):
        check_divisible(three_kv, 4)
    with pytest.raises(ValueError, match="intermediate size 129"):
        check_divisible(dataclasses.replace(config, intermediate_size=129), 2)
    # the engine refuses before it starts any process
    path = make_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="4 attention heads"):
        LLM(str(path), tensor_parallel_size=3, num_kv_blocks=8)


def test_each_rank_holds_its_heads_and_kv_heads_are_replicated_when_too_few(config):
    assert shard_config(config, 2).num_heads == 2 and shard_config(config, 2).num_kv_heads == 1
    four = dataclasses.replace(config, num_heads=8)
    assert shard_config(four, 4).num_kv_heads == 1  # 2 KV heads, 4 ranks: each holds one copy
    firsts = [TensorParallel(rank, 4).first_kv_head(four) for rank in range(4)]
    assert firsts == [0, 0, 1, 1]
    assert [TensorParallel(rank, 2).first_kv_head(config) for rank in range(2)] == [0, 1]


def test_a_slice_reads_only_its_part_and_pads_the_vocabulary(tmp_path):
    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        rows = TensorSlice(0, 3, 2, 3).read(f.get_slice("w"))  # rank 1 of 2 over 5 rows: 2 + 1 pad
        cols = TensorSlice(1, 1, 2, 2).read(f.get_slice("w"))
        zeros = TensorSlice(0, 0, 5, 5, zero=True).read(f.get_slice("w"))
    assert torch.equal(rows, torch.cat([full[3:], torch.zeros(1, 3)]))
    assert torch.equal(cols, full[:, 1:3])
    assert torch.equal(zeros, torch.zeros(5, 3))


def _parallel(**options):
    return EngineConfig(**options).resolve().parallel


def test_ranks_meet_by_options_or_by_torchruns_environment():
    one = Rendezvous.from_options(_parallel(tensor_parallel_size=2), environ={})
    assert one.rank == 0 and one.spawn_ranks == (1,) and one.master_addr == "127.0.0.1"
    node0 = Rendezvous.from_options(
        _parallel(tensor_parallel_size=4, nnodes=2, node_rank=0, master_addr="10.0.0.1"), environ={}
    )
    node1 = Rendezvous.from_options(
        _parallel(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234),
        environ={},
    )
    assert (node0.rank, node0.spawn_ranks, node0.master_port) == (0, (1,), 29500)
    assert (node1.rank, node1.spawn_ranks, node1.runs_engine) == (None, (2, 3), False)
    assert node1.init_method == "tcp://10.0.0.1:1234"
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "7"}
    torchrun = Rendezvous.from_options(_parallel(tensor_parallel_size=2), environ=env)
    assert (torchrun.rank, torchrun.spawn_ranks, torchrun.external) == (1, (), True)
    with pytest.raises(ValueError, match="torchrun started 2 processes but tensor_parallel_size is 4"):
        Rendezvous.from_options(_parallel(tensor_parallel_size=4), environ=env)
