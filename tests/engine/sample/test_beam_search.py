"""Beam search on forked block tables equals a plain beam search over transformers' logits."""

import random

import pytest
import torch

from pagedkv import LLM, BeamSearchParams
from pagedkv.engine import RequestLimits
from pagedkv.engine.sample.beam_search import BeamState, Hypothesis, best_hypotheses, rank_candidates
from tests.checkpoints import TEST_VOCAB_SIZE, make_checkpoint

EOS = frozenset({1, 3})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("beams"), "llama")


def _prompts():
    rng = random.Random(11)
    return [[rng.randrange(4, TEST_VOCAB_SIZE) for _ in range(n)] for n in (6, 13)]


def reference_beam_search(path, prompt, params, model=None):
    """The same ranking rules, recomputing every beam from scratch with transformers (or with
    ``model``, e.g. a PEFT model, when given)."""
    import transformers

    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = BeamState(params, EOS)
    beams = [Hypothesis([], 0.0)]
    with torch.no_grad():
        for _ in range(params.max_tokens):
            rows = []
            for beam in beams:
                logits = model(torch.tensor([prompt + beam.token_ids])).logits[0, -1].float()
                rows.append(logits.log_softmax(dim=-1))
            survivors, ended = rank_candidates(rows, [b.cumulative_logprob for b in beams], state)
            for c in ended:
                state.finished.append(Hypothesis(beams[c.parent].token_ids + [c.token], c.score, True))
            beams = [Hypothesis(beams[c.parent].token_ids + [c.token], c.score) for c in survivors]
            if not beams:
                break
    return best_hypotheses(state, beams)


@pytest.mark.parametrize("width", [2, 4])
def test_beams_equal_the_transformers_reference(model_path, width):
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=1.0)
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4)
    outs = llm.beam_search(_prompts(), params, use_tqdm=False)
    for prompt, out in zip(_prompts(), outs, strict=True):
        expected = reference_beam_search(model_path, prompt, params)
        assert [c.token_ids for c in out.outputs] == [h.token_ids for h in expected]
        got = [c.cumulative_logprob for c in out.outputs]
        assert got == pytest.approx([h.cumulative_logprob for h in expected], abs=1e-4)
    assert llm.kv_stats()["blocks_used"] == 0


def test_beams_share_blocks_and_dropped_beams_free_theirs(model_path):
    prompt = _prompts()[1] * 3  # 39 tokens: 9 full blocks of 4 shared by every beam
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_beam_request("b", prompt, BeamSearchParams(beam_width=4, max_tokens=8))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        live = [s for s in engine.requests["b"].seqs if not s.is_finished] if "b" in engine.requests else []
        used = engine.kv_manager.usage().used_blocks
        peak = max(peak, used)
        # Every block in use is held by a live beam: dropped beams returned theirs at once.
        held = {b for s in live for b in engine.kv_manager.block_ids(s.seq_id)}
        assert used == len(held)
    unshared = 4 * -(-(39 + 8) // 4)
    assert peak < unshared / 2
    assert engine.kv_manager.usage().used_blocks == 0


def test_beam_search_survives_preemption(model_path):
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    roomy = LLM(str(model_path), dtype="float32", num_kv_blocks=256, block_size=4).beam_search(
        _prompts(), params, use_tqdm=False
    )
    # Its beams outgrow the pool together, so they run by preemption: a budget set above the pool
    # (the default, what the pool holds, refuses such a request).
    tight = LLM(
        str(model_path),
        dtype="float32",
        num_kv_blocks=12,
        block_size=4,
        watermark=0.0,
        decode_headroom=0.0,
        limits=RequestLimits(max_request_tokens=4096),
    )
    outs = tight.beam_search(_prompts(), params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in roomy
    ]
    assert tight.kv_stats()["preemptions"] > 0
    assert tight.kv_stats()["blocks_used"] == 0


def test_beam_params_are_validated():
    with pytest.raises(ValueError, match="BeamSearchParams.beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    with pytest.raises(ValueError, match="BeamSearchParams.max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
