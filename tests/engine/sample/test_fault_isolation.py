"""A request whose sampling raises fails alone; every other request of the step goes on exactly.

The fault is injected into one function, the sampler's draw (``inverse_cdf_draw``): it raises
after drawing whenever one chosen request's generator is in the batch, so the batched call fails
after the seeded bystanders' generators have already advanced. The bystanders' tokens must still
equal those of a run where the failing request never existed.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.engine.sample import sampler as sampler_module
from tests.checkpoints import make_checkpoint

OPTIONS = dict(dtype="float32", num_kv_blocks=128, block_size=4, max_model_len=128)
BYSTANDERS = [
    ([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)),
    ([9, 10, 11], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ([12, 13], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=4, n=2, ignore_eos=True)),
    (
        [14, 15, 16, 17, 18],
        SamplingParams(max_tokens=8, temperature=0.7, seed=5, logprobs=2, ignore_eos=True),
    ),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("faults"), "llama")


def _tokens(output):
    return [c.token_ids for c in output.outputs]


@pytest.mark.parametrize("fail_at_step", [0, 3])
def test_a_failing_request_ends_with_an_error_and_the_others_are_unaffected(
    model_path, monkeypatch, fail_at_step
):
    expected = LLM(str(model_path), **OPTIONS).generate(
        [p for p, _ in BYSTANDERS], [s for _, s in BYSTANDERS], use_tqdm=False
    )
    llm = LLM(str(model_path), **OPTIONS)
    engine = llm.engine
    for i, (prompt, params) in enumerate(BYSTANDERS):
        engine.add_request(f"ok-{i}", prompt, params)
    victim = engine.add_request(
        "victim", [20, 21, 22], SamplingParams(max_tokens=20, temperature=1.0, seed=9)
    )
    target = victim.seqs[0].generator
    draws = {"victim": 0}
    real_draw = sampler_module.inverse_cdf_draw

    def failing_draw(probs, generators):
        tokens = real_draw(probs, generators)  # every seeded row has drawn: the rewind is needed
        if any(g is target for g in generators):
            draws["victim"] += 1
            if draws["victim"] > fail_at_step:
                raise RuntimeError("injected sampling fault")
        return tokens

    monkeypatch.setattr(sampler_module, "inverse_cdf_draw", failing_draw)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    failed = finished.pop("victim")
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    assert len(failed.outputs[0].token_ids) == fail_at_step
    assert "injected sampling fault" in failed.error
    for i, out in enumerate(expected):
        got = finished[f"ok-{i}"]
        assert got.error is None
        assert _tokens(got) == _tokens(out)
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in out.outputs]
    assert engine.kv_manager.num_seqs == 0
    assert llm.kv_stats()["blocks_used"] == 0


def test_a_sampler_failing_for_every_row_fails_every_request_and_leaks_nothing(model_path, monkeypatch):
    llm = LLM(str(model_path), **OPTIONS)

    def broken(*_):
        raise RuntimeError("broken sampler")

    monkeypatch.setattr(sampler_module, "ban_stop_tokens", broken)
    outputs = llm.generate([[5, 6], [7, 8, 9]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["error", "error"]
    assert all("broken sampler" in o.error for o in outputs)
    assert llm.kv_stats()["blocks_used"] == 0 and not llm.engine.has_unfinished_requests()
