"""SpeculativeConfig: vLLM's two shapes parse; every bad value is refused naming its field."""

from __future__ import annotations

import pytest

from pagedkv.config import SpeculativeConfig


def test_ngram_config_keeps_its_bounds():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    )
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max, config.model) == (2, 5, None)


@pytest.mark.parametrize(
    ("given", "bounds"),
    [({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2))],
)
def test_ngram_bounds_default_as_in_vllm(given, bounds):
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == bounds


@pytest.mark.parametrize("method", [None, "draft_model"])
def test_a_model_means_a_draft_model(method, tmp_path):
    data = {"model": str(tmp_path), "num_speculative_tokens": 2}
    if method:
        data["method"] = method
    config = SpeculativeConfig.from_dict(data)
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", str(tmp_path), 2)


def test_vllms_legacy_ngram_model_name_means_prompt_lookup():
    config = SpeculativeConfig.from_dict({"model": "ngram", "num_speculative_tokens": 2})
    assert (config.method, config.model) == ("ngram", None)


def test_disable_by_batch_size_is_kept():
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}
    )
    assert config.disable_by_batch_size == 8


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method", "not supported"),
        (
            {"method": "deepseek_mtp", "num_speculative_tokens": 2},
            "speculative_config.method",
            "not supported",
        ),
        ({"method": "mtp", "num_speculative_tokens": 2}, "speculative_config.method", "not supported"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "speculative_config.method", "must be"),
        ({"num_speculative_tokens": 2}, "speculative_config.method", "required"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens", "required"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "speculative_config.num_speculative_tokens",
            "positive",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": True},
            "speculative_config.num_speculative_tokens",
            "positive",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2.5},
            "speculative_config.num_speculative_tokens",
            "positive",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "speculative_config.prompt_lookup_min",
            "positive",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
            "<=",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "/some/dir"},
            "speculative_config.model",
            "does not use",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model", "folder"),
        (
            {"model": "/d", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
            "speculative_config.prompt_lookup_max",
            "only applies",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
            "speculative_config.disable_by_batch_size",
            "positive",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_spec_tokens": 3},
            "speculative_config.num_spec_tokens",
            "not a setting",
        ),
    ],
)
def test_bad_configs_are_refused_naming_the_field(data, field, words):
    with pytest.raises(ValueError) as error:
        SpeculativeConfig.from_dict(data)
    assert field in str(error.value) and words in str(error.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"ngram"'])
def test_the_cli_value_must_be_a_json_object(text):
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_json(text)


def test_the_engine_config_takes_a_dict_or_json_and_refuses_a_bad_one():
    from pagedkv.engine import EngineConfig

    given = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = EngineConfig(speculative_config=given).speculative_config
    assert config == SpeculativeConfig.from_dict(given)
    assert EngineConfig(speculative_config='{"model": "stdlib-llama-draft", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config must be a dict or JSON text"):
        EngineConfig(speculative_config=4)


def test_the_command_line_flag_parses_json_and_refuses_bad_json(capsys):
    from pagedkv.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    )
    assert args.speculative_config == SpeculativeConfig("ngram", 3, None, 5, 5)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(
            ["generate", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}']
        )
    assert exit_info.value.code == 2
    assert "'eagle' is not supported" in capsys.readouterr().err
