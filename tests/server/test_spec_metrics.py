"""A speculating server: vLLM's speculative-decoding counters on /metrics and the dashboard's
acceptance figures follow the engine's drafts; a server that does not speculate has neither."""

from __future__ import annotations

import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine import EngineConfig
from pagedkv.server import ServerThread, create_app
from pagedkv.server.dashboard.frames import take_view
from tests.server.helpers import API_KEY, ENGINE_OPTIONS, MODEL, scrape, wait_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
PYTHON = "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n"
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def test_spec_decode_counters_follow_the_engines_drafts():
    config = EngineConfig(**ENGINE_OPTIONS, speculative_config=NGRAM)
    with ServerThread(create_app(config, api_key=API_KEY)) as server:
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as client:
            client.completions.create(
                model=MODEL, prompt=PYTHON, max_tokens=48, temperature=0.0, extra_body={"ignore_eos": True}
            )
        metrics = wait_idle(server.base_url)
        text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        engine = server.app.state.engine.engine  # idle now: read directly
        totals = engine.stats().spec_decoding
        view = take_view(engine, time.time())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0
    for name in COUNTERS:
        assert families[f"vllm:spec_decode_{name}"].type == "counter"
        assert metrics[f"vllm:spec_decode_{name}_total"] == getattr(totals, name)
    for position, count in enumerate(totals.num_accepted_tokens_per_pos):
        assert metrics[f"vllm:spec_decode_num_accepted_tokens_per_pos_total{{position={position}}}"] == count
    assert view.stats["specDrafts"] == totals.num_drafts
    assert view.stats["specAccepted"] == totals.num_accepted_tokens


def test_a_server_without_speculation_exports_no_spec_counter(base_url, engine):
    assert not [name for name in scrape(base_url) if name.startswith("vllm:spec_decode")]
    assert "specDrafts" not in take_view(engine, time.time()).stats
