"""``pagedkv bench capacity --hybrid`` (``capacity-hybrid``) at a small scale: the live engines
hold more sequences with hybrid paging at the same KV budget, and every block comes back."""

from pagedkv.bench.hybrid_capacity import HybridCapacityConfig, print_hybrid_capacity, run_hybrid_capacity


def test_hybrid_paging_holds_more_sequences_at_one_budget():
    # a step computes a whole context: few steps (a quick test), a prompt in one chunk
    config = HybridCapacityConfig(scale=256, budget_contexts=4, block_size=4, max_num_batched_tokens=32768)
    result = run_hybrid_capacity(config)
    assert result.ok
    runs = {run.shape: run for run in result.runs}
    for run in runs.values():
        assert run.context == 128 and run.finished == {"hybrid": 32, "full": 32}
        # the same bytes: blocks one group deep are more blocks (less the null block)
        assert run.pool_blocks["full"] == 4 * 128 // 4
        assert run.peak_running["full"] == 4
    assert runs["gemma2"].pool_blocks["hybrid"] == 2 * 128 - 1
    assert runs["gemma3"].pool_blocks["hybrid"] == 6 * 128 - 1
    assert runs["gemma2"].ratio > 1.3
    assert runs["gemma3"].ratio > 2.5
    for run in runs.values():
        assert run.ratio <= run.bound(config.block_size)
    from rich.console import Console

    console = Console(record=True, width=200)
    print_hybrid_capacity(result, console)
    assert "gemma3" in console.export_text()


def test_the_bound_at_32k_contexts():
    """The closed form the report sets beside the figures, at the full shapes' lengths."""
    from pagedkv.bench.hybrid_capacity import SHAPES, ShapeRun

    assert round(ShapeRun("gemma2", 4096, 32768, 0, SHAPES["gemma2"][0]).bound(16), 3) == 1.777
    assert round(ShapeRun("gemma3", 1024, 32768, 0, SHAPES["gemma3"][0]).bound(16), 2) == 5.18


def test_a_models_layer_kinds_and_window_are_measured(tmp_path):
    """``--model``: the folder's layer kinds and window, not the built-in shapes."""
    import json

    from pagedkv.bench.hybrid_capacity import model_layout, shape_config

    folder = tmp_path / "gemma3-like"
    folder.mkdir()
    layout = (True, True, False)
    (folder / "config.json").write_text(json.dumps(shape_config(layout, 1024, 512)), encoding="utf-8")
    assert model_layout(folder) == (layout, 512)
    config = HybridCapacityConfig(model=str(folder), scale=256)
    assert config.layouts() == {"gemma3-like": (layout, 512)}
