"""``model="org/name"``: Hugging Face Hub ids resolved through huggingface_hub's cache, offline.

The cache is built on disk (``tests/hub_cache.py``) and HF_HUB_OFFLINE is set for every test
(``tests/conftest.py``): nothing here reaches the network.
"""

from __future__ import annotations

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.models.hub import is_hub_id, resolve_model
from tests.checkpoints import make_checkpoint
from tests.hub_cache import add_snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["def add(a, b):", "hello world"]


def _tokens(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def hub(tmp_path):
    """A cache holding ``org/tiny`` twice: ``main`` (seed 0) and the tag ``v2`` (seed 1)."""
    cache = tmp_path / "hub"
    first, second = make_checkpoint(tmp_path), make_checkpoint(tmp_path, seed=1)
    snapshots = (add_snapshot(cache, "org/tiny", first), add_snapshot(cache, "org/tiny", second, ("v2",)))
    return {"cache": cache, "folders": (first, second), "snapshots": snapshots}


def test_a_hub_id_loads_its_cached_snapshot_offline(hub):
    with LLM("org/tiny", download_dir=str(hub["cache"]), num_kv_blocks=64) as llm:
        assert llm.engine.model_path == hub["snapshots"][0]
        assert llm.engine.model_source.repo_id == "org/tiny"
        assert "org/tiny" in llm.engine.describe()
        from_hub = _tokens(llm)
    with LLM(str(hub["folders"][0]), num_kv_blocks=64) as llm:
        assert from_hub == _tokens(llm)


@pytest.mark.parametrize("by", ["tag", "commit"])
def test_a_revision_loads_that_snapshot(hub, by):
    snapshot = hub["snapshots"][1]
    revision = "v2" if by == "tag" else snapshot.name
    with LLM("org/tiny", revision=revision, download_dir=str(hub["cache"]), num_kv_blocks=64) as llm:
        assert llm.engine.model_path == snapshot
        second = _tokens(llm)
    with LLM(str(hub["folders"][1]), num_kv_blocks=64) as llm:
        assert second == _tokens(llm)
    with LLM(str(hub["folders"][0]), num_kv_blocks=64) as llm:
        assert second != _tokens(llm)  # the two snapshots are told apart by what they generate


def test_the_cache_may_come_from_hf_hub_cache_through_huggingface_hub(hub, monkeypatch):
    """Without download_dir the cache is huggingface_hub's own (HF_HUB_CACHE when it started)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    assert resolve_model("org/tiny").folder == hub["snapshots"][0]


def test_a_missing_id_is_one_clear_error(hub):
    with pytest.raises(FileNotFoundError) as caught:
        LLM("org/missing", download_dir=str(hub["cache"]))
    message = str(caught.value)
    assert "'org/missing'" in message and "revision 'main'" in message
    assert "HF_HUB_OFFLINE=1" in message and str(hub["cache"]) in message
    assert "\n" not in message


def test_a_missing_revision_names_it(hub):
    with pytest.raises(FileNotFoundError, match="'org/tiny' \\(revision 'v3'\\).*HF_HUB_OFFLINE=1"):
        resolve_model("org/tiny", revision="v3", download_dir=hub["cache"])


def test_a_local_folder_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    local.parent.mkdir()
    hub["folders"][1].rename(local)
    monkeypatch.chdir(tmp_path)
    source = resolve_model("org/tiny", download_dir=hub["cache"])
    assert source.folder.resolve() == local and source.repo_id is None


@pytest.mark.parametrize(
    ("model", "hub_id"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("org/name.v1_2", True),
        ("name", False),
        ("/models/org/name", False),
        ("./org/name", False),
        ("org/name/extra", False),
        ("org/../name", False),
        ("org--x/name", False),
    ],
)
def test_what_reads_as_a_hub_id(model, hub_id):
    assert is_hub_id(model) is hub_id


def test_a_path_that_is_no_hub_id_keeps_the_folder_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path / "nowhere" / "to" / "be"))


def test_a_sharded_snapshot_loads_through_its_index(tmp_path):
    sharded = make_checkpoint(tmp_path, max_shard_size="40KB")
    snapshot = add_snapshot(tmp_path / "hub", "org/sharded", sharded)
    assert len(list(snapshot.glob("*.safetensors"))) > 1
    with LLM("org/sharded", download_dir=str(tmp_path / "hub"), num_kv_blocks=64) as llm:
        assert llm.engine.model_path == snapshot
        from_hub = _tokens(llm)
    with LLM(str(sharded), num_kv_blocks=64) as llm:
        assert from_hub == _tokens(llm)
