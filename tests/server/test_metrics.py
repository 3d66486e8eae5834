"""/metrics parsed with prometheus-client's own parser agrees with what responses reported."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kvtier.config import parse_offloading_config
from server.metrics import ServerMetrics
from tests.server.conftest import engine_of, start_stream_then_leave

CHAT = {"messages": [{"role": "user", "content": "Describe a lighthouse at night."}], "max_tokens": 6, "temperature": 0}


async def scrape(client) -> dict[str, list]:
    text = await (await client.get("/metrics")).text()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples, name, **labels) -> float:
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


async def test_counters_agree_with_reported_usage_and_histograms_move(client):
    before = await scrape(client)
    usages = []
    for i in range(3):
        body = {**CHAT, "messages": [{"role": "user", "content": f"Describe lighthouse number {i}."}]}
        usages.append((await (await client.post("/v1/chat/completions", json=body)).json())["usage"])
    after = await scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("zenserve:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("zenserve:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("zenserve:request_success_total", finished_reason="length") == 3
    assert value(after, "zenserve:request_success_total", finished_reason="abort") == 0  # pre-created
    assert delta("zenserve:time_to_first_token_seconds_count") == 3
    assert delta("zenserve:e2e_request_latency_seconds_count") == 3
    assert delta("zenserve:request_queue_time_seconds_count") == 3
    assert delta("zenserve:request_decode_time_seconds_count") == 3
    assert delta("zenserve:inter_token_latency_seconds_count") == 3 * 5
    assert delta("zenserve:prefix_cache_queries_total") >= sum(u["prompt_tokens"] for u in usages)
    assert delta("zenserve:prefix_cache_hits_total") == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert delta("zenserve:http_requests_total", route="/v1/chat/completions", status="200") == 3
    assert 0 <= value(after, "zenserve:kv_cache_usage_perc") <= 1
    assert value(after, "zenserve:num_requests_running") == 0


async def test_offload_loads_show_in_metrics(make_client):
    offload = parse_offloading_config({"cpu_bytes_to_use": "32M"})
    client = await make_client(engine={"offload": offload})
    await client.post("/v1/chat/completions", json=CHAT)
    engine = engine_of(client)
    engine.core.connector.flush()
    engine.core.scheduler.finish_loads_now()
    assert engine.core.kv.reset_prefix_cache()  # the engine's cache only: the CPU tier keeps it
    await client.post("/v1/chat/completions", json=CHAT)  # now served from the CPU tier
    samples = await scrape(client)
    assert value(samples, "zenserve:kv_offload_loads_total") == 1
    assert value(samples, "zenserve:kv_offload_load_bytes_total") > 0
    assert value(samples, "zenserve:kv_offload_store_bytes_total") > 0
    assert value(samples, "zenserve:external_prefix_cache_hits_total") > 0
    assert value(samples, "zenserve:kv_offload_tiering_chunk_hits_total", tier="cpu") >= 1
    engine.core.shutdown()


async def test_clients_that_go_away_count_as_aborts_and_499_not_as_server_errors(client):
    before = await scrape(client)
    body = {**CHAT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    for _ in range(2):
        await start_stream_then_leave(client, body)

    def delta(samples, name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    for _ in range(250):  # the handlers notice the closed connections on their next write
        after = await scrape(client)
        if delta(after, "zenserve:http_requests_total", route="/v1/chat/completions") == 2:
            break
        await asyncio.sleep(0.02)
    assert delta(after, "zenserve:request_success_total", finished_reason="abort") == 2
    assert delta(after, "zenserve:http_requests_total", route="/v1/chat/completions", status="499") == 2
    assert delta(after, "zenserve:http_requests_total", status="500") == 0
    generated = delta(after, "zenserve:generation_tokens_total")
    assert 2 <= generated < 2 * 400  # what was generated before each client left


async def test_inter_token_gaps_are_per_choice_across_prompts(client):
    before = await scrape(client)
    body = {"prompt": ["One lighthouse", "Two harbours", "Three ships"], "max_tokens": 5, "ignore_eos": True,
            "temperature": 0}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and len((await resp.json())["choices"]) == 3
    after = await scrape(client)
    # 4 gaps within each choice's 5 tokens; none between tokens of different prompts.
    name = "zenserve:inter_token_latency_seconds_count"
    assert value(after, name) - value(before, name) == 3 * 4


async def test_each_engine_step_is_counted_with_its_tokens_time_and_gap(client):
    before = await scrape(client)
    body = {"prompt": "A lighthouse keeper counts the ships", "max_tokens": 7, "ignore_eos": True, "temperature": 0}
    usage = (await (await client.post("/v1/completions", json=body)).json())["usage"]
    after = await scrape(client)

    def delta(name):
        return value(after, name) - value(before, name)

    # One prefill step (the prompt is well under a step's token budget), then a decode step per token
    # but the last: each computes the token sampled before it.
    steps = usage["completion_tokens"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] + steps - 1
    assert delta("zenserve:iteration_tokens_total_count") == steps
    assert delta("zenserve:iteration_tokens_total_sum") == computed
    assert delta("zenserve:engine_step_duration_seconds_count") == steps
    assert delta("zenserve:engine_step_duration_seconds_sum") > 0
    # The engine idled before the first step: no gap for it, one before each step after.
    assert delta("zenserve:engine_step_gap_seconds_count") == steps - 1
    assert 0 < delta("zenserve:engine_step_gap_seconds_sum") < delta("zenserve:engine_step_duration_seconds_sum")
    decode_steps = [s for s in after["zenserve:iteration_tokens_total_bucket"] if s.labels["le"] == "1.0"]
    decode_steps_before = [s for s in before.get("zenserve:iteration_tokens_total_bucket", []) if s.labels["le"] == "1.0"]
    assert sum(s.value for s in decode_steps) - sum(s.value for s in decode_steps_before) == steps - 1


def test_finish_reasons_are_precreated_for_the_loaded_models_name_only():
    metrics = ServerMetrics("zenserve")  # the placeholder while the model loads
    metrics.set_model_name("SmolLM2")
    samples = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    names = {s.labels["model_name"] for s in samples["zenserve:request_success_total"]}
    assert names == {"SmolLM2"}
    reasons = {s.labels["finished_reason"] for s in samples["zenserve:request_success_total"]}
    assert reasons == {"stop", "length", "abort"}
