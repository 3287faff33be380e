"""A model folder without tokenizer.json (or ``skip_tokenizer_init``) runs token-id prompts; only
what needs text fails, with a message that says why."""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.cli import main
from pagedkv.engine import InvalidRequestError
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33], [40, 2, 11]]


@pytest.fixture
def bare_model(tmp_path):
    """A checkpoint folder with its tokenizer files removed, and the same one complete."""
    path = make_checkpoint(tmp_path, "llama")
    complete = make_checkpoint(tmp_path, "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)
    return path, complete


def test_token_id_prompts_run_without_a_tokenizer(bare_model):
    bare, complete = bare_model
    want = LLM(str(complete), dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = LLM(str(bare), dtype="float32")
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.outputs[0].text == "" for o in got)
    assert llm.kv_stats()["blocks_used"] == 0


@pytest.mark.parametrize("skip", [False, True])
def test_text_and_stop_strings_fail_only_when_asked_for(bare_model, skip):
    bare, complete = bare_model
    llm = LLM(str(complete if skip else bare), dtype="float32", skip_tokenizer_init=skip)
    reason = "skip_tokenizer_init is set" if skip else "no tokenizer.json in"
    with pytest.raises(InvalidRequestError, match=reason):
        llm.generate("some text", GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="no stop strings"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="bad_words cannot be tokenized") as refused:
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, bad_words=["x"]), use_tqdm=False)
    assert refused.value.param == "bad_words"
    assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    assert llm.kv_stats()["blocks_used"] == 0 and not llm.engine.has_unfinished_requests()


def test_cli_generates_from_token_ids_without_a_tokenizer(bare_model, capsys):
    bare, _ = bare_model
    common = ["--model", str(bare), "--max-tokens", "3", "--num-kv-blocks", "32"]
    assert main(["generate", "5,9,17", "--token-ids", *common]) == 0
    out = capsys.readouterr().out
    assert "(length)" in out and "engine:" in out
    assert main(["generate", "hello", *common]) == 1
    assert "no tokenizer.json in" in capsys.readouterr().out
