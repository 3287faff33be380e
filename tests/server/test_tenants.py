"""What one client may ask of the others, through the official ``openai`` client over real HTTP.

``cache_salt`` (vLLM's) keeps a tenant's prefix cache apart: read from ``/metrics``, a prompt
sent under another salt hits nothing that one salt computed, and the same salt hits its own
blocks. ``priority`` under ``--scheduling-policy priority`` is bounded: outside the deployer's
range it is a 400 naming the field and the range.
"""

from __future__ import annotations

import openai
import pytest

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, MODEL, assert_pool_whole, scrape, wait_idle

OPTIONS = dict(num_kv_blocks=128, block_size=16, max_model_len=256, max_num_seqs=8)
#: Long enough for several full blocks of 16 tokens, and sent by no other test.
PROMPT = "tenant isolation check: " + " ".join(f"paged block {i} keeps its keys" for i in range(12))


@pytest.fixture(scope="module")
def server():
    app = create_app(EngineConfig(scheduling_policy="priority", **OPTIONS), api_key=API_KEY)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(autouse=True)
def _leaves_server_idle(server):
    yield
    wait_idle(server.base_url)
    assert_pool_whole(server.app.state.engine.engine)


def _hits(server) -> float:
    return scrape(server.base_url)["vllm:prefix_cache_hits_total"]


def _complete(client, server, salt: str | None, chat: bool = False) -> tuple[float, str]:
    """One greedy request under ``salt``: the prefix-cache hit tokens it added, and its text."""
    before = _hits(server)
    extra = {} if salt is None else {"cache_salt": salt}
    if chat:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=3,
            temperature=0.0,
            extra_body=extra,
        )
        text = reply.choices[0].message.content
    else:
        reply = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0.0, extra_body=extra
        )
        text = reply.choices[0].text
    wait_idle(server.base_url)
    return _hits(server) - before, text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_no_prefix_cache_hit_crosses_a_salt(client, server, chat):
    salts = [f"{chat}-tenant-a", f"{chat}-tenant-b", f"{chat}-tenant-a", None, None]
    runs = [_complete(client, server, salt, chat) for salt in salts]
    hits = [hit for hit, _ in runs]
    assert hits[0] == 0 and hits[1] == 0  # a's blocks are not b's, nor were anyone's before
    assert hits[2] >= 32  # a finds its own blocks again
    assert hits[3] == 0  # unsalted finds no salted block
    assert hits[4] == hits[2]  # and shares with unsalted ones as before
    assert len({text for _, text in runs}) == 1  # the same text under every salt


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("salt", ["", 7])
def test_a_bad_salt_is_a_400_naming_it(client, chat, salt):
    with pytest.raises(openai.BadRequestError) as err:
        if chat:
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
                extra_body={"cache_salt": salt},
            )
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"cache_salt": salt})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "cache_salt"


@pytest.mark.parametrize("priority", [-1000, 101, 10**25])
def test_a_priority_outside_the_range_is_a_400_naming_it(client, priority):
    for create in (
        lambda: client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"priority": priority}
        ),
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"priority": priority},
        ),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.body["param"] == "priority"
        assert "outside the allowed range [-100, 100]" in err.value.body["message"]


@pytest.mark.parametrize("priority", [-100, 0, 100])
def test_a_priority_in_the_range_is_served(client, priority):
    reply = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"priority": priority, "ignore_eos": True}
    )
    assert reply.usage.completion_tokens == 2
