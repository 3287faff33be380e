"""Bad adapters and bad LoRA options are refused with errors that name them, and the engine keeps
serving: a bad adapter's request never takes engine state."""

import json
import re

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import InvalidRequestError
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-errors")
    base = make_checkpoint(tmp, "llama")
    good = make_adapter(tmp / "good", base, seed=1)
    other = make_adapter(tmp / "other", make_checkpoint(tmp, "llama", hidden_size=32, head_dim=8), seed=1)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    yield tmp, good, other, llm
    llm.shutdown()


def _edited(tmp, good, name, **fields):
    """A copy of the good adapter with ``fields`` set in its adapter_config.json."""
    folder = tmp / name
    folder.mkdir()
    for file in good.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | fields))
    return folder


def _truncated(tmp, good):
    folder = _edited(tmp, good, "truncated")
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return folder


def _without_weights(tmp, good):
    folder = _edited(tmp, good, "noweights")
    (folder / "adapter_model.safetensors").unlink()
    return folder


CASES = {
    "missing folder": (lambda tmp, good, other: tmp / "nowhere", "does not exist"),
    "no weights": (
        lambda tmp, good, other: _without_weights(tmp, good),
        "adapter_model.safetensors is missing",
    ),
    "truncated": (lambda tmp, good, other: _truncated(tmp, good), "truncated or corrupt"),
    "another base model": (lambda tmp, good, other: other, "another base model"),
    "rank over the limit": (lambda tmp, good, other: _edited(tmp, good, "r16", r=16), "over max_lora_rank 8"),
    "unknown target": (
        lambda tmp, good, other: _edited(tmp, good, "lm", target_modules=["q_proj", "lm_head"]),
        "['lm_head'] are not supported",
    ),
    "DoRA": (lambda tmp, good, other: _edited(tmp, good, "dora", use_dora=True), "use_dora (DoRA)"),
    "modules_to_save": (
        lambda tmp, good, other: _edited(tmp, good, "mts", modules_to_save=["lm_head"]),
        "modules_to_save",
    ),
    "bias": (lambda tmp, good, other: _edited(tmp, good, "bias", bias="all"), "bias"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_adapter_is_refused_by_name_and_the_engine_serves_on(setup, name):
    tmp, good, other, llm = setup
    make, message = CASES[name]
    folder = make(tmp, good, other)
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        llm.generate([[5, 6, 7]], PARAMS, lora_request=LoRARequest("bad", 99, str(folder)), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert 99 not in [lora.lora_int_id for lora in llm.engine.list_loras()]
    served = llm.generate([[5, 6, 7]], PARAMS, lora_request=LoRARequest("good", 1, str(good)), use_tqdm=False)
    assert len(served[0].outputs[0].token_ids) == 3


def test_an_id_or_name_of_another_adapter_is_refused(setup):
    tmp, good, other, llm = setup
    llm.engine.add_lora(LoRARequest("good", 1, str(good)))
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is adapter 'good'"):
        llm.engine.add_lora(LoRARequest("renamed", 1, str(good)))
    with pytest.raises(InvalidRequestError, match="named 'good' is loaded already"):
        llm.engine.add_lora(LoRARequest("good", 2, str(good)))


def test_lora_requests_need_enable_lora(tmp_path):
    base = make_checkpoint(tmp_path, "llama")
    adapter = make_adapter(tmp_path / "a", base, seed=1)
    with LLM(str(base), dtype="float32", num_kv_blocks=32) as llm:
        with pytest.raises(InvalidRequestError, match="enable_lora=True"):
            llm.generate([[5, 6]], PARAMS, lora_request=LoRARequest("a", 1, str(adapter)), use_tqdm=False)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_loras": 0}, "max_loras must be a positive integer"),
        ({"max_lora_rank": 128}, "max_lora_rank must be at most 64"),
    ],
)
def test_bad_lora_options_are_refused_by_name(options, message):
    from pagedkv.engine import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(enable_lora=True, **options)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora_name": ""}, "lora_name"),
        ({"lora_int_id": 0}, "lora_int_id must be a positive integer"),
        ({"lora_path": ""}, "lora_path"),
    ],
)
def test_bad_lora_request_fields_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(**({"lora_name": "a", "lora_int_id": 1, "lora_path": "/x"} | fields))
