"""Mixtral, Qwen2-MoE and Qwen3-MoE (:mod:`pagedkv.models.moe`) against transformers, in float32.

The tiny checkpoints route each token to 2 or 3 of 4-8 experts, so every step mixes experts;
Qwen3-MoE renormalises its top-k weights (``norm_topk_prob``), Qwen2-MoE does not and adds its
gated shared expert, one of its layers dense (``mlp_only_layers``); one Mixtral slides a window
shorter than the prompts. Exact through the packed forward (torch and C attention) and ``LLM``
(block sizes 1 and 16, chunked prefill, prefix-cache hits), loaded from what ``save_pretrained``
writes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagedkv import LLM, SamplingParams
from pagedkv.attention import resolve_backend
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.models.decode_stack import describe
from pagedkv.models.layer_ops import TORCH_OPS
from pagedkv.models.moe import MoeForCausalLM, RouteExperts, Router, route
from pagedkv.models.moe_config import MoeConfig
from pagedkv.models.moe_native import native_experts
from pagedkv.models.ops import ForwardBatch, Project
from pagedkv.models.parallel import (
    ColumnParallelGateUp,
    TensorParallel,
    TensorSlice,
    check_divisible,
    shard_config,
)
from pagedkv.models.quantized import QuantizedLinear
from tests.checkpoints import make_checkpoint, to_v4_config
from tests.engine.spec.test_engine_spec import NGRAM

from .hf_reference import (
    MAX_NEW,
    TOL,
    assert_greedy_tokens_match,
    assert_packed_logits_match,
    hf_greedy,
    hf_logits,
    hf_model,
    long_prompts,
)
from .paging import PagedBatch

MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
QWEN2MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],
}
QWEN3MOE = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "norm_topk_prob": True}
CASES = {
    "mixtral": ("mixtral", MIXTRAL),
    "mixtral-sliding": ("mixtral", {**MIXTRAL, "sliding_window": 12}),
    "qwen2moe-shared-dense-layer": ("qwen2moe", QWEN2MOE),
    "qwen3moe-renormalised": ("qwen3moe", QWEN3MOE),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for name, (arch, overrides) in CASES.items():
        path = make_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides)
        refs[name] = (path, hf_model(path))
    return refs


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", list(CASES))
def test_packed_prefill_and_decode_logits_match_transformers(references, case, backend):
    assert_packed_logits_match(*references[case], backend)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16])
def test_greedy_tokens_equal_transformers(references, case, block_size):
    assert_greedy_tokens_match(*references[case], block_size)


def test_the_c_stack_runs_the_experts(references):
    model = load_model(references["mixtral"][0])
    assert isinstance(model, MoeForCausalLM)
    assert describe(model) == "C stack"
    assert describe(load_model(references["qwen2moe-shared-dense-layer"][0])) == "C stack"


def test_every_expert_of_every_layer_writes_into_one_set_of_outputs(references):
    """The experts run one after another (and the layers too): the gate/up and down outputs
    small batches are written into are one pair for the model, not one per expert and layer."""
    model = load_model(references["qwen2moe-shared-dense-layer"][0], dtype=torch.float32)
    blocks = [op for op in model.decoder_ops().sequence() if isinstance(op, RouteExperts)]
    mlps = [mlp for block in blocks for mlp in (*block.experts, block.shared[1])]
    assert len(blocks) > 1 and len(mlps) > 2 * len(blocks)
    for position in (0, 1):  # the gate/up output, the down output
        ptrs = {mlp[position].output.get(2, 8, torch.float32).data_ptr() for mlp in mlps}
        assert len(ptrs) == 1


def test_the_checkpoints_store_each_expert_under_its_family_names(references):
    names = {}
    for case in ("mixtral", "qwen2moe-shared-dense-layer"):
        with safe_open(str(references[case][0] / "model.safetensors"), "pt") as f:
            names[case] = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names["mixtral"]
    assert "model.layers.0.block_sparse_moe.gate.weight" in names["mixtral"]
    qwen = names["qwen2moe-shared-dense-layer"]
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in qwen
    assert "model.layers.0.mlp.shared_expert_gate.weight" in qwen
    assert "model.layers.1.mlp.gate_proj.weight" in qwen  # the dense layer
    assert not any(name.startswith("model.layers.1.mlp.experts") for name in qwen)


def test_the_config_reads_each_family_as_transformers_does(references):
    mixtral = ModelConfig.from_pretrained(references["mixtral"][0]).moe
    assert mixtral == MoeConfig(4, 2, 128, renormalize=True, float32_weights=True)
    qwen2 = ModelConfig.from_pretrained(references["qwen2moe-shared-dense-layer"][0])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen2.moe == MoeConfig(8, 2, 32, False, False, shared_expert_size=64, dense_layers=(1,))
    qwen3 = ModelConfig.from_pretrained(references["qwen3moe-renormalised"][0])
    assert qwen3.qk_norm and qwen3.moe.renormalize and qwen3.moe.top_k == 3
    sliding = ModelConfig.from_pretrained(references["mixtral-sliding"][0])
    assert sliding.layer_types == ("sliding_attention",) * sliding.num_layers


def test_a_4x_config_reads_the_same(references, tmp_path):
    for case in ("mixtral", "qwen2moe-shared-dense-layer", "qwen3moe-renormalised"):
        arch, overrides = CASES[case]
        path = make_checkpoint(tmp_path, arch, **overrides)
        v5 = ModelConfig.from_pretrained(path)
        to_v4_config(path)
        assert ModelConfig.from_pretrained(path) == v5


RAW = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4}


def test_config_defaults_are_transformers():
    mixtral = ModelConfig.from_dict(
        {**RAW, "architectures": ["MixtralForCausalLM"], "num_attention_heads": 1}
    )
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.rope.theta) == (8, 2, 1e6)
    raw = {**RAW, "architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 1}
    qwen2 = ModelConfig.from_dict({**raw, "decoder_sparse_step": 2})
    assert (qwen2.moe.num_experts, qwen2.moe.top_k, qwen2.moe.expert_size) == (60, 4, 1408)
    assert (qwen2.moe.shared_expert_size, qwen2.moe.dense_layers) == (5632, (0, 2))
    assert qwen2.attention_bias and not qwen2.moe.renormalize
    qwen3 = ModelConfig.from_dict({**raw, "architectures": ["Qwen3MoeForCausalLM"]})
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.shared_expert_size) == (128, 8, None)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok must be between 1 and"),
        ({"num_experts": 0}, "num_experts must be a positive integer"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
        ({"mlp_only_layers": [4]}, r"mlp_only_layers must name layers 0\.\.3"),
        ({"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window needs its layer_types"),
        ({"shared_expert_intermediate_size": 0}, "shared_expert_size must be a positive integer"),
    ],
)
def test_bad_moe_configs_raise_clear_errors(changes, message):
    raw = {**RAW, "architectures": ["Qwen2MoeForCausalLM"], "num_attention_heads": 1}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, **changes})


def test_each_switch_changes_the_logits(references, tmp_path):
    """transformers' logits move far beyond the tolerance without the renormalisation or the
    shared expert, so the exactness tests above would catch a model that skipped either."""
    seq = [5 + i for i in range(20)]
    _, renormalised = references["qwen3moe-renormalised"]
    plain = hf_model(make_checkpoint(tmp_path, "qwen3moe", **{**QWEN3MOE, "norm_topk_prob": False}))
    assert (hf_logits(plain, seq) - hf_logits(renormalised, seq)).abs().max().item() > 100 * TOL
    path, shared = references["qwen2moe-shared-dense-layer"]
    unshared = hf_model(path)  # its own copy: the fixture's model stays the reference
    with torch.no_grad():
        for layer in unshared.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                layer.mlp.shared_expert_gate.weight.fill_(-1e4)  # sigmoid 0: no shared expert
    assert (hf_logits(unshared, seq) - hf_logits(shared, seq)).abs().max().item() > 100 * TOL


def test_route_renormalises_only_where_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    experts, weights = route(logits, MoeConfig(4, 2, 8, renormalize=False, float32_weights=False))
    probs = logits.softmax(-1)[0]
    assert experts.tolist() == [[0, 1]] and torch.allclose(weights, probs[:2])
    _, renormed = route(logits, MoeConfig(4, 2, 8, renormalize=True, float32_weights=True))
    assert torch.allclose(renormed, probs[:2] / probs[:2].sum())
    _, bf16 = route(logits.bfloat16(), MoeConfig(4, 2, 8, renormalize=True, float32_weights=False))
    assert bf16.dtype == torch.bfloat16


def test_a_batch_of_32_runs_each_active_expert_once(references):
    """One decode-sized batch through a sparse layer: each expert's products run at most once,
    over exactly the rows that chose it (each row appears top_k times in all), and the result is
    the per-row sum over each row's experts."""
    model = load_model(references["qwen2moe-shared-dense-layer"][0], attention_backend="torch")
    op = next(op for op in model.model.layers[0].ops() if isinstance(op, RouteExperts))
    calls: list[int] = []  # rows per call of an expert's down projection
    for _, down in op.experts:
        real = down.project
        object.__setattr__(down, "project", lambda h, real=real: (calls.append(h.shape[0]), real(h))[1])
    x = torch.randn(32, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    batch = _batch(x)
    chosen, weights = route(op.router.run(x, None, batch)[0], op.moe)
    counts = torch.bincount(chosen.flatten(), minlength=op.moe.num_experts)
    got = op.grouped(x, chosen, weights, batch)
    assert sorted(calls) == sorted(c for c in counts.tolist() if c) and sum(calls) == 32 * 2
    assert len(calls) > 1
    for t in (0, 17, 31):
        want = sum(
            w * _expert(op, e, x[t : t + 1], batch) for e, w in zip(chosen[t], weights[t], strict=True)
        )
        assert torch.allclose(got[t], want[0], atol=1e-6)


def _batch(x: torch.Tensor) -> ForwardBatch:
    """What the experts read of a step: its element-wise ops (nothing of attention)."""
    return ForwardBatch(TORCH_OPS, cos=x, sin=x, kv_cache=None, metadata=None, backend=None)


def _expert(op: RouteExperts, e: torch.Tensor, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    act, down = op.experts[int(e)]
    return Project.run(down, act.run(x, None, batch)[0], None, batch)[0]


def test_each_rank_holds_its_rows_of_every_expert(references):
    """Tensor parallelism (exact against one rank in tests/engine/worker/test_tensor_parallel.py)
    cuts each expert and the shared one by intermediate rows, replicates the routers, and leaves
    the experts' down projections unreduced: the block all-reduces once."""
    cfg = ModelConfig.from_pretrained(references["qwen2moe-shared-dense-layer"][0])
    local = shard_config(cfg, 2)
    assert (local.moe.expert_size, local.moe.shared_expert_size, local.intermediate_size) == (16, 32, 64)
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_size=30))
    with pytest.raises(ValueError, match=r"expert intermediate size 30 not divisible by 4"):
        check_divisible(odd, 4)
    model = TensorParallel(1, 2).build(cfg, resolve_backend("torch", torch.device("cpu")))
    slices = TensorParallel(1, 2).checkpoint_slices(model)
    layer = "model.layers.0.mlp"
    assert slices[f"{layer}.experts.3.up_proj.weight"] == TensorSlice(0, 16, 16, 16, blocks=True)
    assert slices[f"{layer}.experts.3.down_proj.weight"] == TensorSlice(1, 16, 16, 16, blocks=True)
    assert slices[f"{layer}.shared_expert.gate_proj.weight"] == TensorSlice(0, 32, 32, 32, blocks=True)
    assert f"{layer}.gate.weight" not in slices and f"{layer}.shared_expert_gate.weight" not in slices
    block = model.model.layers[0].sparse_block
    assert block.all_reduce is not None and not block.experts[3].down_proj.reduce
    assert model.model.layers[1].mlp.down_proj.reduce  # the dense layer reduces as Llama's


def test_a_ranks_experts_run_in_the_c_call_and_its_partial_sums_add_up_to_one_devices(references):
    """Each rank's experts (its gate/up rows, paired and tiled, and its down columns) go through
    the same C call as one device's; its output is the rank's partial sum, and the two ranks'
    add up to one device's output, shared expert included."""
    path = references["qwen2moe-shared-dense-layer"][0]
    whole = load_model(path, "float32")
    x = torch.randn(9, whole.config.hidden_size, generator=torch.Generator().manual_seed(3))
    want = native_experts(x, whole.model.layers[0].sparse_block, whole.config.moe)
    partials = []
    for rank in range(2):
        shard = load_model(path, "float32", tensor_parallel=TensorParallel(rank, 2))
        layer = shard.model.layers[0]
        assert isinstance(layer.sparse_block.experts[0].gate_up_proj, ColumnParallelGateUp)
        layer.sparse_block.all_reduce = lambda out: out  # the rank's partial sum, as the ranks' add it up
        op = next(op for op in layer.ops() if isinstance(op, RouteExperts))
        assert native_experts(x, op.block, op.moe) is not None
        partials.append(op.run(x, None, _batch(x))[0])
    assert want is not None and torch.allclose(partials[0] + partials[1], want, atol=1e-5)


def test_a_missing_expert_weight_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "mixtral", **MIXTRAL)
    file = path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(file))
    with pytest.raises(
        ValueError, match=r"lacks 1 weights: \['model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"
    ):
        load_model(path)


def test_an_expert_count_the_weights_do_not_have_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3moe", **QWEN3MOE)
    config = path / "config.json"
    config.write_text(config.read_text().replace('"num_local_experts": 8', '"num_local_experts": 6'))
    with pytest.raises(
        ValueError, match=r"mlp\.gate\.weight .* shape \(8, 64\), but the config implies \(6, 64\)"
    ):
        load_model(path)


def _step(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    return PagedBatch(model, max(map(len, seqs)), len(seqs)).step(seqs)


def test_bfloat16_and_q8_0_on_load_track_the_float_model(references):
    """bfloat16 weights and Q8_0 experts (in GGUF blocks on the CPU, the routers kept in
    float32 as llama.cpp keeps them) stay close to the float32 model, shared expert included:
    nine rows in ten within a tenth of the logits' spread, every row within it (a near tie of
    two experts may route a row to the other one)."""
    path = references["qwen2moe-shared-dense-layer"][0]
    seqs = long_prompts(seed=3)[:3]
    want = torch.cat(_step(load_model(path, dtype="float32"), seqs))
    q8 = load_model(path, dtype="float32", quantization="q8_0")
    block = q8.model.layers[0].mlp
    assert isinstance(block.experts[0].down_proj, QuantizedLinear)
    assert isinstance(block.shared_expert.gate_up_proj, QuantizedLinear)
    assert isinstance(block.gate, Router) and isinstance(block.shared_expert_gate, Router)
    for model in (load_model(path, dtype="bfloat16"), q8):
        got = torch.cat(_step(model, seqs))
        assert got.dtype == torch.float32
        rows = (got - want).abs().max(dim=-1).values
        spread = want.std().item()
        assert rows.min() > 0 and rows.max() < spread
        assert (rows < 0.1 * spread).float().mean() >= 0.9


def test_speculation_and_preemption_change_no_token(references):
    """n-gram drafts verified as k + 1 rows per sequence (each routed on its own) and a KV pool
    too small for every sequence at once (preemption, recompute): transformers' greedy tokens."""
    path, hf = references["qwen2moe-shared-dense-layer"]
    tiny = {"block_size": 4, "num_kv_blocks": 24, "watermark": 0.0, "decode_headroom": 0.0}
    llm = LLM(str(path), dtype="float32", speculative_config=NGRAM, **tiny)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(long_prompts(), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, long_prompts(), MAX_NEW)
    assert llm.kv_stats()["preemptions"] > 0
    assert llm.engine.verifier.speculator.totals.num_drafts > 0
    assert llm.kv_stats()["blocks_used"] == 0
