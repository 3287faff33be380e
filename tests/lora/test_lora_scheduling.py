"""More adapters than slots in one batch: a sequence is admitted only while its adapter is
resident or a slot can be taken from an idle one, base requests never wait for a slot, an
adapter is removed only when no request holds it, and every block comes back."""

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import InvalidRequestError
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter
from tests.server.helpers import assert_pool_whole


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-sched")
    base = make_checkpoint(tmp, "llama")
    folders = [make_adapter(tmp / f"a{i}", base, seed=i, rank=2) for i in range(3)]
    return base, [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]


def test_adapters_take_turns_in_one_slot_while_base_requests_run(adapters):
    base, loras = adapters
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=2, num_kv_blocks=64
    ) as llm:
        engine = llm.engine
        for i, lora in enumerate([*loras, None, *loras, None]):
            engine.add_request(str(i), [5 + i, 6, 7], params, lora_request=lora)
        first = True
        while engine.has_unfinished_requests():
            engine.step()
            running = engine.scheduler.running
            assert len({s.request.lora_int_id for s in running if s.request.lora_request}) <= 1
            if first:  # base requests were admitted at once, past the waiting adapters
                assert sum(s.request.lora_request is None for s in running) == 2
                first = False
        residency = engine.scheduler.adapters
        assert residency.loads >= 3 and residency.evictions == residency.loads - 1
        assert_pool_whole(engine)


def test_an_adapter_in_use_cannot_be_removed(adapters):
    base, loras = adapters
    params = SamplingParams(max_tokens=2, temperature=0.0)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=2, num_kv_blocks=32) as llm:
        engine = llm.engine
        engine.add_request("held", [5, 6], params, lora_request=loras[0])
        with pytest.raises(InvalidRequestError, match="in use by a request"):
            engine.remove_lora(loras[0].lora_int_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.remove_lora(loras[0].lora_int_id)
        assert engine.scheduler.adapters.slots() == {}
        assert engine.list_loras() == []
        assert_pool_whole(engine)


def test_an_adapter_whose_folder_fails_to_load_is_loaded_anew_later(adapters, tmp_path):
    """The folder is read again when the adapter takes a slot; if that read fails its request
    ends with ``"error"`` naming why (the step goes on), and the adapter is not taken for
    resident: once the folder is back, its tokens are right."""
    import shutil

    base, loras = adapters
    folder = tmp_path / "moved"
    shutil.copytree(loras[0].lora_path, folder)
    lora = LoRARequest("moved", 9, str(folder))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=2, num_kv_blocks=32) as llm:
        engine = llm.engine
        engine.add_request("r", [5, 6, 7], params, lora_request=lora)
        weights = folder / "adapter_model.safetensors"
        saved = weights.read_bytes()
        weights.unlink()
        (out,) = engine.step()
        assert out.finished and out.outputs[0].finish_reason == "error"
        assert "adapter_model.safetensors is missing" in out.error
        assert not engine.has_unfinished_requests()
        assert engine.scheduler.adapters.slot_of(9) is None
        assert not engine.scheduler.paged_adapters.pages.is_resident(9)
        weights.write_bytes(saved)
        again = llm.generate([[5, 6, 7]], params, lora_request=lora, use_tqdm=False)[0]
        same = llm.generate([[5, 6, 7]], params, lora_request=loras[0], use_tqdm=False)[0]
        assert again.outputs[0].token_ids == same.outputs[0].token_ids
        assert_pool_whole(engine)
