"""LoRA adapters over HTTP with the official ``openai`` client: a request's ``model`` names an
adapter, ``/v1/models`` lists them under the base model, and adapters are loaded and unloaded
while the server runs, only from the allowed folder and only with the API key."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter
from tests.server.process import SERVE, ServeProcess, free_port

KEY = "lora-key"
BASE = "tiny-base"
PROMPT = [5, 9, 33, 7, 100, 4, 61]
OPTIONS = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-serve")
    base = make_checkpoint(tmp, "llama")
    allowed = tmp / "adapters"
    first = make_adapter(allowed / "first", base, seed=1)
    second = make_adapter(allowed / "second", base, seed=2, targets=("q_proj", "down_proj"))
    outside = make_adapter(tmp / "outside", base, seed=3)
    app = create_app(
        EngineConfig(model=str(base), **OPTIONS),
        api_key=KEY,
        served_model_name=BASE,
        lora_modules=[f"first={first}"],
        lora_dirs=[str(allowed)],
    )
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
        yield server.base_url, client, base, first, second, outside


@pytest.fixture(scope="module")
def expected(setup) -> dict[str, str]:
    """``LLM.generate``'s text of the prompt under each adapter and the base model."""
    _, _, base, first, second, _ = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    loras = [None, LoRARequest("first", 1, str(first)), LoRARequest("second", 2, str(second))]
    with LLM(str(base), **OPTIONS) as llm:
        outs = llm.generate([PROMPT] * 3, params, lora_request=loras, use_tqdm=False)
    return dict(zip([BASE, "first", "second"], [o.outputs[0].text for o in outs], strict=True))


def _complete(client, model: str) -> str:
    response = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    return response.choices[0].text


def test_a_request_naming_an_adapter_runs_it(setup, expected):
    client = setup[1]
    assert expected["first"] != expected[BASE]
    assert _complete(client, "first") == expected["first"]
    assert _complete(client, BASE) == expected[BASE]


def test_models_lists_the_adapters_under_the_base_model(setup):
    _, client, _, first, _, _ = setup
    cards = {m.id: m for m in client.models.list().data}
    assert cards["first"].model_extra["parent"] == BASE
    assert cards["first"].model_extra["root"] == str(first)
    assert cards[BASE].model_extra["parent"] is None


def test_load_then_unload_an_adapter_at_run_time(setup, expected):
    base_url, client, _, _, second, _ = setup
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "second", "lora_path": str(second)}
    loaded = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers)
    assert loaded.status_code == 200, loaded.text
    assert "second" in [m.id for m in client.models.list().data]
    assert _complete(client, "second") == expected["second"]
    again = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers)
    assert again.status_code == 400 and "already been loaded" in again.text
    unloaded = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=headers)
    assert unloaded.status_code == 200
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        _complete(client, "second")
    gone = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "second"}, headers=headers)
    assert gone.status_code == 404


def test_loading_needs_the_key_and_an_allowed_folder(setup):
    base_url, client, _, _, second, outside = setup
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "stray", "lora_path": str(second)}
    assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=body).status_code == 401
    body = {"lora_name": "stray", "lora_path": str(outside)}
    refused = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers)
    assert refused.status_code == 403 and "--lora-dir" in refused.text
    escape = {"lora_name": "stray", "lora_path": str(second / ".." / ".." / "outside")}
    assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=escape, headers=headers).status_code == 403
    assert "stray" not in [m.id for m in client.models.list().data]


def test_a_bad_adapter_is_refused_by_name_and_the_server_serves_on(setup, expected):
    base_url, client, _, _, second, _ = setup
    broken = second.parent / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"lora_name": "broken", "lora_path": str(broken)}
    refused = httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, headers=headers)
    assert refused.status_code == 400 and "adapter_config.json is not valid JSON" in refused.text
    assert _complete(client, "first") == expected["first"]


def test_pagedkv_serve_takes_the_lora_options(setup):
    _, _, base, first, _, _ = setup
    options = ["--model", str(base), "--dtype", "float32", "--num-kv-blocks", "32", "--api-key", KEY]
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"first={first}"]
    with ServeProcess(*options, *lora) as server:
        headers = {"Authorization": f"Bearer {KEY}"}
        cards = httpx.get(f"{server.base_url}/v1/models", headers=headers).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [(base.name, None), ("first", base.name)]
        body = {"model": "first", "prompt": PROMPT, "max_tokens": 2}
        completion = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert completion.status_code == 200, completion.text
        assert (
            httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={}, headers=headers).status_code == 404
        )
    assert server.returncode == 0


def test_a_bad_lora_module_stops_the_start(setup):
    _, _, base, _, _, outside = setup
    options = ["--model", str(base), "--num-kv-blocks", "32", "--enable-lora", "--max-lora-rank", "2"]
    command = [sys.executable, "-c", SERVE, "serve", "--port", str(free_port()), *options]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ended = subprocess.run(
        [*command, "--lora-modules", f"big={outside}"], capture_output=True, text=True, env=env, timeout=120
    )
    assert ended.returncode == 2  # a usage error, not a crash
    assert "--lora-modules:" in ended.stderr and "LoRA rank 4 is over max_lora_rank 2" in ended.stderr
    assert "Traceback" not in ended.stderr


def test_unloading_an_adapter_a_running_request_holds_is_a_400(setup):
    """The adapter's pages are pinned by the running request: the unload is refused, naming why,
    and succeeds once the request has ended."""
    from tests.server.helpers import EngineGate, complete_in_background

    _, _, base, first, _, _ = setup
    app = create_app(EngineConfig(model=str(base), **OPTIONS), lora_dirs=[str(first.parent)])
    with ServerThread(app) as server:
        engine = server.app.state.engine.engine
        body = {"lora_name": "held", "lora_path": str(first)}
        assert httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body).status_code == 200
        with EngineGate(engine) as gate:
            gate.close()
            thread = complete_in_background(server.base_url, model="held", prompt=PROMPT, max_tokens=8)
            gate.open_until(lambda outputs: bool(engine.scheduler.running))
            assert gate.holding.wait(60)
            (adapter,) = engine.kv_snapshot().adapters
            assert adapter.name == "held" and adapter.pins == 1
            unload = {"lora_name": "held"}
            refused = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json=unload)
            assert refused.status_code == 400 and "in use by a request" in refused.text
        thread.join(120)
        done = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json=unload)
        assert done.status_code == 200 and engine.kv_snapshot().adapters == ()
