"""/metrics: vLLM's names and types, and values that follow what the server actually did."""

from __future__ import annotations

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import API_KEY, MODEL, EngineGate, scrape, wait_idle

EXPECTED_TYPES = {
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


def test_metrics_use_vllm_names_and_types_and_need_no_api_key(base_url):
    response = httpx.get(f"{base_url}/metrics")  # no Authorization: /metrics is not under /v1
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, kind in EXPECTED_TYPES.items():
        assert families[name].type == kind, name
        assert all(s.labels["model_name"] == MODEL for s in families[name].samples)


def test_token_counters_and_latency_histograms_follow_a_request(base_url):
    before = scrape(base_url)
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        usage = client.completions.create(
            model=MODEL, prompt="count my tokens", max_tokens=9, extra_body={"ignore_eos": True}
        ).usage
    after = wait_idle(base_url)

    def delta(name):
        return after[name] - before[name]

    assert delta("vllm:prompt_tokens_total") == usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == usage.completion_tokens == 9
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 8  # one gap between each of 9 tokens
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_success_total{finished_reason=length}") == 1
    assert 0 < delta("vllm:time_to_first_token_seconds_sum") <= delta("vllm:e2e_request_latency_seconds_sum")


def test_prefix_cache_counters_count_tokens(base_url):
    prompt = [5 + i for i in range(40)]  # 40 tokens: two full blocks of 16 can be reused
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30).raise_for_status()
    before = wait_idle(base_url)
    httpx.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30).raise_for_status()
    after = wait_idle(base_url)
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] >= 32
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == 32


def test_kv_usage_gauge_rises_while_a_request_runs(base_url, engine):
    body = {"model": MODEL, "prompt": "hold blocks", "max_tokens": 120, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with EngineGate(engine) as gate:
        gate.open_until(lambda outputs: any(o.outputs[0].text for o in outputs))  # held once it shows text
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=30) as r:
            lines = r.iter_lines()  # kept: closing it would close the connection
            next(line for line in lines if line.startswith("data: "))
            during = scrape(base_url)
    assert during["vllm:kv_cache_usage_perc"] > 0
    assert during["vllm:num_requests_running"] == 1
    assert (
        during["vllm:kv_cache_usage_perc"]
        == during["pagedkv:kv_cache_blocks_used"] / during["pagedkv:kv_cache_blocks_total"]
    )
    wait_idle(base_url)
