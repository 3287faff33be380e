"""One request inside every limit does not starve a small one sent after it, over real HTTP.

A real server (the built-in model on a 64-block pool, 8 running slots) gets a large request --
many samples of one prompt, or many prompts -- and, once that one runs, a two-token bystander.
What is asserted is the order in which the engine finishes them (the engine is held between
steps while the bystander is queued, so the large request has run exactly one step when it
arrives), never a time; and that every block comes back. The same requests on a server without
a share (``max_running_share=1``, first come first served) are the control: there the bystander
waits for the large request.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.server import ServerThread, create_app
from tests.server.helpers import API_KEY, MODEL, EngineGate, assert_pool_whole, wait_idle, wait_until

OPTIONS = dict(num_kv_blocks=64, block_size=16, max_model_len=256, max_num_seqs=8)
#: In every limit (the pool's 1,024 tokens bound a request's samples x (prompt + max_tokens)),
#: each holding more than the 8 running slots.
LARGE = {
    "samples": ({"prompt": "def", "n": 16, "max_tokens": 40, "ignore_eos": True}, 1),
    "prompts": ({"prompt": ["def f"] * 12, "max_tokens": 40, "ignore_eos": True}, 12),
}
BYSTANDER = {"prompt": "def", "max_tokens": 2, "ignore_eos": True}


class FinishOrder:
    """An engine observer: after which loop of the server's worker each engine request was gone."""

    def __init__(self) -> None:
        self.loops = 0
        self.live: set[str] = set()
        self.finished_at: dict[str, int] = {}

    def observe(self, engine: LLMEngine) -> None:
        self.loops += 1
        now = set(engine.requests)
        for request_id in self.live - now:
            self.finished_at[request_id] = self.loops
        self.live = now

    def due_in(self) -> float | None:
        return None


def _serve(**options):
    app = create_app(EngineConfig(**(OPTIONS | options)), api_key=API_KEY)
    with ServerThread(app) as running:
        yield running


@pytest.fixture(scope="module")
def fair_server():
    yield from _serve()


@pytest.fixture(scope="module")
def fcfs_server():
    yield from _serve(max_running_share=1.0)


@pytest.fixture(scope="module")
def priority_server():
    yield from _serve(scheduling_policy="priority", max_num_seqs=1)


def _post(base_url: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(
        f"{base_url}/v1/completions", json={"model": MODEL, **body}, headers=headers, timeout=300
    )


def _large_then_bystander(server, large: dict, engine_requests: int) -> tuple[FinishOrder, set[str], str]:
    """Send ``large`` (``engine_requests`` engine requests), let it run one step, then send the
    bystander; returns the finish order, the large request's engine ids and the bystander's."""
    base_url, engine = server.base_url, server.app.state.engine.engine
    order = FinishOrder()
    server.app.state.engine.observers.append(order)
    with ThreadPoolExecutor(2) as clients, EngineGate(engine) as gate:
        gate.close()
        large_reply = clients.submit(_post, base_url, large)
        wait_until(lambda: len(engine.requests) == engine_requests, 30, "the large request to be queued")
        large_ids = set(engine.requests)
        gate.open_until(lambda outputs: bool(outputs))  # its first step: it runs
        assert gate.holding.wait(60)
        small_reply = clients.submit(_post, base_url, BYSTANDER)
        wait_until(lambda: len(engine.requests) == engine_requests + 1, 30, "the bystander to be queued")
        (small_id,) = set(engine.requests) - large_ids
        gate.open_until(lambda outputs: False)
        large_body, small_body = large_reply.result().json(), small_reply.result().json()
    # A reply can reach its client before the worker's loop that finished it calls its observers.
    everyone = large_ids | {small_id}
    wait_until(lambda: everyone <= order.finished_at.keys(), 30, "the worker to observe every finish")
    server.app.state.engine.observers.remove(order)
    samples = large.get("n", 1) * (len(large["prompt"]) if isinstance(large["prompt"], list) else 1)
    assert [c["finish_reason"] for c in large_body["choices"]] == ["length"] * samples
    assert large_body["usage"]["completion_tokens"] == samples * large["max_tokens"]
    assert small_body["usage"]["completion_tokens"] == BYSTANDER["max_tokens"]
    wait_idle(base_url)
    assert_pool_whole(engine)
    return order, large_ids, small_id


@pytest.mark.parametrize("kind", list(LARGE))
def test_a_two_token_request_finishes_before_a_large_one_sent_first(fair_server, kind):
    order, large_ids, small_id = _large_then_bystander(fair_server, *LARGE[kind])
    # Before any of the large request's engine requests (all the prompts of one HTTP request
    # count as one client request: it is their share together that is limited).
    assert order.finished_at[small_id] < min(order.finished_at[i] for i in large_ids)


@pytest.mark.parametrize("kind", list(LARGE))
def test_without_a_share_the_bystander_waits_for_the_large_one(fcfs_server, kind):
    order, large_ids, small_id = _large_then_bystander(fcfs_server, *LARGE[kind])
    assert order.finished_at[small_id] > min(order.finished_at[i] for i in large_ids)


def test_a_request_priority_orders_admission_over_http(priority_server):
    """One running slot: three requests queued while the engine is held finish by priority."""
    base_url, engine = priority_server.base_url, priority_server.app.state.engine.engine
    order = FinishOrder()
    priority_server.app.state.engine.observers.append(order)
    priorities = [2, 0, 1]
    with ThreadPoolExecutor(3) as clients, EngineGate(engine) as gate:
        gate.close()
        ids, replies = [], []
        for count, priority in enumerate(priorities, start=1):
            replies.append(clients.submit(_post, base_url, {**BYSTANDER, "priority": priority}))
            wait_until(lambda count=count: len(engine.requests) == count, 30, "the request to be queued")
            (new,) = set(engine.requests) - set(ids)
            ids.append(new)
        gate.open_until(lambda outputs: False)
        assert [reply.result().status_code for reply in replies] == [200] * 3
    wait_until(lambda: set(ids) <= order.finished_at.keys(), 30, "the worker to observe every finish")
    priority_server.app.state.engine.observers.remove(order)
    finished = sorted(ids, key=lambda i: order.finished_at[i])
    assert finished == [ids[1], ids[2], ids[0]]  # priority 0, 1, 2
    wait_idle(base_url)
    assert_pool_whole(engine)
