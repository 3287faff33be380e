"""The model's own sampling defaults (generation_config.json) in ``LLM`` and ``LLMEngine``.

vLLM's ``--generation-config``: "auto" reads the sampling fields of the model's file, "vllm"
ignores them, a folder reads the file there; ``LLM.generate`` without sampling parameters runs
with them, an explicit ``SamplingParams`` is taken as given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.models.generation_config import default_sampling_params
from tests.checkpoints import make_checkpoint
from tests.real_model import copy_of_real_model

PROMPTS = ["def add(a, b):", "hello world"]
OVERRIDE_LOG = "Default sampling parameters have been overridden by the model's Hugging Face generation"


def _set_generation_config(folder: Path, **fields) -> None:
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))


def _tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture
def greedy_model(tmp_path) -> Path:
    """A tiny checkpoint whose generation_config.json asks for greedy decoding and 5 tokens."""
    folder = make_checkpoint(tmp_path)
    _set_generation_config(folder, temperature=0.0, max_new_tokens=5, do_sample=False)
    return folder


def test_generate_without_params_runs_the_models_defaults(greedy_model, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine"):
        llm = LLM(str(greedy_model), num_kv_blocks=64)
    with llm:
        [line] = [r.getMessage() for r in caplog.records if OVERRIDE_LOG in r.getMessage()]
        assert "{'temperature': 0.0, 'max_tokens': 5}" in line
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5)
        first = _tokens(llm.generate(PROMPTS, use_tqdm=False))
        again = _tokens(llm.generate(PROMPTS, use_tqdm=False))
        greedy = _tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False))
        assert first == again == greedy
        assert all(len(tokens) == 5 for tokens in first)  # max_new_tokens is max_tokens
        # An explicit SamplingParams is taken as given: vLLM's temperature 1.0 and 16 tokens.
        sampled = llm.generate(PROMPTS, SamplingParams(seed=3, ignore_eos=True), use_tqdm=False)
        assert [len(tokens) for tokens in _tokens(sampled)] == [16, 16]
        assert [tokens[:5] for tokens in _tokens(sampled)] != greedy


def test_generation_config_vllm_ignores_the_models_defaults(greedy_model, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine"):
        llm = LLM(str(greedy_model), num_kv_blocks=64, generation_config="vllm")
    with llm:
        assert not [r for r in caplog.records if OVERRIDE_LOG in r.getMessage()]
        assert llm.engine.default_sampling_params == {}
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.engine.get_default_sampling_params().temperature == 1.0


def test_generation_config_may_name_another_folder(tmp_path, greedy_model):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"top_k": 5, "top_p": 0.5, "min_p": 0.1}))
    assert default_sampling_params(greedy_model, str(elsewhere)) == {"top_k": 5, "top_p": 0.5, "min_p": 0.1}
    with LLM(str(greedy_model), num_kv_blocks=64, generation_config=str(elsewhere)) as llm:
        params = llm.get_default_sampling_params()
        assert (params.top_k, params.top_p, params.min_p, params.temperature) == (5, 0.5, 0.1, 1.0)


def test_a_folder_without_generation_config_is_refused(tmp_path, greedy_model):
    with pytest.raises(FileNotFoundError, match="generation_config '.*empty' is neither 'auto', 'vllm' nor"):
        LLM(str(greedy_model), generation_config=str(tmp_path / "empty"))


def test_only_vllms_fields_count_and_null_is_unset(tmp_path):
    folder = make_checkpoint(tmp_path)
    _set_generation_config(
        folder, do_sample=False, num_beams=4, top_p=None, repetition_penalty=1.3, length_penalty=2.0
    )
    assert default_sampling_params(folder) == {"repetition_penalty": 1.3}
    assert default_sampling_params(folder, "vllm") == {}
    # do_sample alone says nothing to vLLM: without a temperature, requests sample at 1.0
    _set_generation_config(folder, repetition_penalty=None)
    assert default_sampling_params(folder) == {}


def test_a_bad_default_stops_the_start_naming_the_field(tmp_path):
    folder = make_checkpoint(tmp_path)
    _set_generation_config(folder, temperature=-1)
    with pytest.raises(ValueError, match="generation_config.json sets a bad default: .*temperature"):
        LLM(str(folder), num_kv_blocks=64)


def test_the_real_models_greedy_default_equals_explicit_greedy(tmp_path):
    """SmolLM2 with ``"temperature": 0.0`` in its generation_config.json: ``generate`` without
    sampling parameters is its greedy answer, whatever the seed of the call."""
    folder = copy_of_real_model(tmp_path)
    _set_generation_config(folder, temperature=0.0, max_new_tokens=8)
    prompt = ["The capital of France is"]
    with LLM(str(folder), num_kv_blocks=64, max_model_len=256) as llm:
        default = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
        greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
        sampled = llm.generate(prompt, SamplingParams(max_tokens=8, seed=0), use_tqdm=False)[0]
    assert default.token_ids == greedy.outputs[0].token_ids and len(default.token_ids) == 8
    assert default.text != sampled.outputs[0].text  # the explicit temperature 1.0 samples
