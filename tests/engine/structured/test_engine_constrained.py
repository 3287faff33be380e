"""Constrained decoding through the whole engine, on the built-in model and its real tokenizer.

Every constrained output must parse and validate; unconstrained requests sharing the batch
must not move a bit; samples and beams each keep their own grammar state; and constraints
compose with what the sampler and scheduler already do (min_tokens, ignore_eos, stop strings,
penalties, logprobs, preemption). Schemas are bounded (string lengths, integer ranges, no
whitespace between tokens) so that ``max_tokens`` always leaves room to complete them.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from pagedkv import LLM, BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedkv.engine import InvalidRequestError
from pagedkv.models import builtin_model_path

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "active"],
    "additionalProperties": False,
}
JSON_PERSON = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
CODE = r"[A-Z]{3}-[0-9]{2}"
PROMPT = "<|im_start|>user\nA person as JSON<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm():
    with LLM(num_kv_blocks=256, max_model_len=256, max_num_seqs=32) as engine:
        yield engine


def _valid_person(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


def test_seeded_samples_all_parse_and_validate_and_fork_their_own_state(llm):
    """n = 3 at temperature 1: each sample forks the grammar with the blocks, and walks it alone."""
    params = [
        SamplingParams(n=3, max_tokens=48, temperature=1.0, seed=seed, structured_outputs=JSON_PERSON)
        for seed in range(8)
    ]
    outputs = llm.generate([PROMPT] * 8, params, use_tqdm=False)
    texts = [[c.text for c in o.outputs] for o in outputs]
    assert all(c.finish_reason == "stop" for o in outputs for c in o.outputs)
    for text in sum(texts, []):
        _valid_person(text)
    # Sample i draws with seed + i: sample 1 of seed s is sample 0 of seed s + 1 -- which holds
    # only if no sample's grammar state moved with another's tokens.
    assert all(texts[s][1] == texts[s + 1][0] and texts[s][2] == texts[s + 2][0] for s in range(6))
    assert len({t for request in texts for t in request}) >= 8
    assert llm.kv_stats()["blocks_used"] == 0


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (StructuredOutputsParams(regex=CODE), lambda t: re.fullmatch(CODE, t)),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]?'), lambda t: re.fullmatch(r"x\d\d?", t)),
        (
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            lambda t: isinstance(json.loads(t), dict),
        ),
    ],
    ids=["regex", "choice", "grammar", "json_object"],
)
def test_every_kind_of_constraint_holds_at_temperature_one(llm, constraint, check):
    params = SamplingParams(n=4, max_tokens=64, temperature=1.0, seed=3, structured_outputs=constraint)
    (output,) = llm.generate(["x = "], params, use_tqdm=False)
    for completion in output.outputs:
        if completion.finish_reason == "stop":  # json_object may run long: any object is allowed
            assert check(completion.text), completion.text
    assert sum(c.finish_reason == "stop" for c in output.outputs) >= (2 if constraint.json_object else 4)


def test_unconstrained_rows_are_bit_identical_beside_constrained_ones(llm):
    """Greedy tokens and logprobs of unconstrained requests with and without constrained ones
    in the same steps."""
    plain = [SamplingParams(max_tokens=24, temperature=0.0, logprobs=3) for _ in range(3)]
    prompts = ["def f(x):", "import os\n", "class A:"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    constrained = SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=1, structured_outputs=JSON_PERSON)
    mixed = llm.generate(
        [prompts[0], PROMPT, prompts[1], PROMPT, prompts[2]],
        [plain[0], constrained, plain[1], constrained, plain[2]],
        use_tqdm=False,
    )
    together = [mixed[0], mixed[2], mixed[4]]
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [lp.top for lp in a.outputs[0].logprobs] == [lp.top for lp in b.outputs[0].logprobs]


def test_beams_each_follow_the_grammar(llm):
    """Each beam forks the grammar with its blocks: every hypothesis is a complete code, and
    they differ (a beam walking another's grammar state would have been refused its tokens)."""
    params = BeamSearchParams(
        beam_width=3, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=CODE)
    )
    (output,) = llm.beam_search(["x = "], params, use_tqdm=False)
    assert len(output.outputs) == 3
    for beam in output.outputs:
        assert beam.finish_reason == "stop" and re.fullmatch(CODE, beam.text), beam.text
    assert len({beam.text for beam in output.outputs}) == 3
    assert llm.kv_stats()["blocks_used"] == 0


def test_beams_refuse_ignore_eos_with_a_grammar():
    with pytest.raises(ValueError, match="ignore_eos cannot be set with structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True, structured_outputs=JSON_PERSON)


def test_the_grammar_wins_over_min_tokens_once_it_can_only_end(llm):
    """A 6-character code cannot reach min_tokens = 20: once complete, its stop token is allowed."""
    params = SamplingParams(
        n=2,
        max_tokens=30,
        min_tokens=20,
        temperature=1.0,
        seed=5,
        structured_outputs=StructuredOutputsParams(regex=CODE),
    )
    (output,) = llm.generate(["x = "], params, use_tqdm=False)
    for completion in output.outputs:
        assert re.fullmatch(CODE, completion.text) and completion.finish_reason == "stop"


def test_min_tokens_still_bans_the_end_while_the_grammar_could_go_on(llm):
    """``[a-z]+`` may end after one letter; min_tokens keeps it going to at least 6 tokens."""
    params = SamplingParams(
        max_tokens=12,
        min_tokens=6,
        temperature=1.0,
        seed=2,
        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
    )
    (output,) = llm.generate(["x = "], params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) >= 6
    assert re.fullmatch("[a-z]+", output.outputs[0].text)


def test_ignore_eos_still_ends_a_complete_grammar(llm):
    params = SamplingParams(
        max_tokens=30,
        ignore_eos=True,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    (output,) = llm.generate(["x = "], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text in ("alpha", "beta") and completion.finish_reason == "stop"
    assert len(completion.token_ids) < 30


def test_logprobs_cover_only_what_the_grammar_allows(llm):
    params = SamplingParams(
        max_tokens=8,
        temperature=1.0,
        seed=4,
        logprobs=5,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    (output,) = llm.generate(["x = "], params, use_tqdm=False)
    completion = output.outputs[0]
    first = completion.logprobs[0]
    allowed_first = {t for t, lp in first.top if lp > -math.inf}
    decoded = {llm.tokenizer.decode([t]) for t in allowed_first}
    assert decoded <= {"y", "ye", "yes", "n", "no"} and math.isfinite(first.logprob)
    # over the allowed tokens alone the probabilities sum to 1
    assert math.isclose(sum(math.exp(lp) for _, lp in first.top if lp > -math.inf), 1.0, rel_tol=1e-4)


def test_stop_strings_and_penalties_compose_with_a_grammar(llm):
    params = SamplingParams(
        n=2,
        max_tokens=48,
        temperature=1.0,
        seed=9,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        stop=['"active"'],
        structured_outputs=JSON_PERSON,
    )
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    for completion in output.outputs:
        assert completion.finish_reason == "stop" and completion.stop_reason == '"active"'
        assert completion.text.startswith('{"name": "') and '"age": ' in completion.text


def test_preempted_constrained_requests_recompute_and_keep_their_grammar(tmp_path):
    """A pool too small for every request at once: sequences lose their blocks and recompute;
    their grammar state stays with their tokens, so greedy outputs equal a roomy run's."""
    params = SamplingParams(n=2, max_tokens=40, temperature=0.0, structured_outputs=JSON_PERSON)
    prompts = [PROMPT + " " * i for i in range(6)]
    with LLM(num_kv_blocks=256, max_model_len=256) as roomy:
        want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(num_kv_blocks=20, block_size=8, max_model_len=128, decode_headroom=0.0) as tight:
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.kv_stats()["preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    for o in got:
        for c in o.outputs:
            _valid_person(c.text)


def test_an_invalid_spec_is_refused_naming_the_field_and_holds_nothing(llm):
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(["x = ", "y = "], [SamplingParams(max_tokens=4), bad], use_tqdm=False)
    assert refused.value.param == "structured_outputs.regex"
    assert not llm.engine.has_unfinished_requests()
    assert llm.kv_stats()["blocks_used"] == 0


def test_structured_outputs_need_a_tokenizer():
    with LLM(str(builtin_model_path()), skip_tokenizer_init=True, num_kv_blocks=64) as llm:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a"]))
        with pytest.raises(InvalidRequestError, match="skip_tokenizer_init") as refused:
            llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert refused.value.param == "structured_outputs"


def test_a_grammar_compiled_ahead_must_be_the_requests_own(llm):
    engine = llm.engine
    yes_no = StructuredOutputsParams(choice=["yes", "no"])
    ready = engine.structured_outputs.compile_async(yes_no).result()
    other = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="not the one of the request"):
        engine.add_request("mismatch", "x = ", other, grammar=ready)
    engine.add_request(
        "ahead", "x = ", SamplingParams(max_tokens=4, structured_outputs=yes_no), grammar=ready
    )
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].text in ("yes", "no")


def test_under_speculative_decoding_constrained_requests_do_not_speculate_and_still_validate():
    """With n-gram speculation on, a constrained request decodes token by token (its grammar
    does not judge drafts) and says why; an unconstrained one beside it still speculates."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(num_kv_blocks=256, max_model_len=256, max_num_seqs=8, speculative_config=ngram) as spec_llm:
        constrained = SamplingParams(max_tokens=48, temperature=1.0, seed=3, structured_outputs=JSON_PERSON)
        plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        prompts = [PROMPT, "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"]
        person, free = spec_llm.generate(prompts, [constrained, plain], use_tqdm=False)
    assert person.metrics["spec_decode_disabled_reason"] == "structured output"
    assert person.outputs[0].finish_reason == "stop"
    _valid_person(person.outputs[0].text)
    assert "spec_decode_disabled_reason" not in free.metrics and free.metrics["spec_decode_num_drafts"] > 0
