"""The websocket KV-event stream: routable BlockStored, removals, tiers, replay, gaps, auth."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from engine.block_hash import block_hash_to_int, hash_block_tokens
from kvtier.config import parse_offloading_config
from tests.server.conftest import engine_of

CHAT = {"messages": [{"role": "user", "content": "Tell me about the history of tea in China."}],
        "max_tokens": 4, "temperature": 0}


async def events_client(make_client, **kw):
    return await make_client(server={"kv_events": True, **kw.pop("server", {})}, engine={"enable_kv_events": True, **kw.pop("engine", {})}, **kw)


async def receive(ws, timeout=5.0) -> dict:
    msg = await ws.receive(timeout=timeout)
    assert msg.type == aiohttp.WSMsgType.TEXT, msg
    return orjson.loads(msg.data)


async def collect(ws, until, timeout=10.0) -> list[dict]:
    """Messages until `until(events_so_far)` is true."""
    got: list[dict] = []
    deadline = asyncio.get_running_loop().time() + timeout
    while not until(got):
        got.append(await receive(ws, timeout=max(0.1, deadline - asyncio.get_running_loop().time())))
    return got


def stored(messages, medium="GPU"):
    return [e for m in messages for e in m.get("events", []) if e["type"] == "BlockStored" and e["medium"] == medium]


async def prompt_ids(client, body) -> list[int]:
    tok = await (await client.post("/tokenize", json={"messages": body["messages"]})).json()
    return tok["tokens"]


async def test_stored_events_rebuild_the_prompt_blocks_and_chain_their_hashes(make_client):
    client = await events_client(make_client)
    ws = await client.ws_connect("/v1/kv_events")
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    ids = await prompt_ids(client, CHAT)
    n_full = len(ids) // 16
    msgs = await collect(ws, lambda m: sum(len(e["block_hashes"]) for e in stored(m)) >= n_full)
    assert all(m["event_version"] == 1 and m["data_parallel_rank"] is None for m in msgs)
    assert [m["seq"] for m in msgs] == sorted(m["seq"] for m in msgs)
    events = stored(msgs)
    tokens = [t for e in events for t in e["token_ids"]]
    assert tokens[: n_full * 16] == ids[: n_full * 16]
    parent = None
    expected = []
    for i in range(n_full):
        parent = hash_block_tokens(parent, ids[i * 16 : (i + 1) * 16])
        expected.append(block_hash_to_int(parent))
    assert [h for e in events for h in e["block_hashes"]][:n_full] == expected
    assert events[0]["parent_block_hash"] is None and events[0]["block_size"] == 16
    await ws.close()


async def test_eviction_sends_block_removed(make_client):
    client = await events_client(make_client, cache={"kv_cache_memory_bytes": 8 * 2 * 16 * 3 * 64 * 4 * 30})
    ws = await client.ws_connect("/v1/kv_events")
    for topic in ("tea", "coffee", "cocoa", "milk"):
        body = {**CHAT, "messages": [{"role": "user", "content": f"Tell me about {topic}. " * 10}]}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    msgs = await collect(ws, lambda m: any(e["type"] == "BlockRemoved" for x in m for e in x["events"]))
    removed = [e for m in msgs for e in m["events"] if e["type"] == "BlockRemoved"]
    announced = {h for e in stored(msgs) for h in e["block_hashes"]}
    assert removed[0]["medium"] == "GPU" and set(removed[0]["block_hashes"]) <= announced


async def test_offload_tier_events_are_self_describing_with_medium_cpu(make_client):
    offload = parse_offloading_config({"cpu_bytes_to_use": "32M", "self_describing_kv_events": True})
    client = await events_client(make_client, engine={"offload": offload})
    ws = await client.ws_connect("/v1/kv_events")
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    ids = await prompt_ids(client, CHAT)
    msgs = await collect(ws, lambda m: len(stored(m, "CPU")) >= len(ids) // 16)
    cpu = stored(msgs, "CPU")
    assert cpu[0]["token_ids"] == ids[:16] and cpu[0]["block_size"] == 16
    gpu_hashes = [h for e in stored(msgs) for h in e["block_hashes"]]
    assert [e["block_hashes"][0] for e in cpu] == gpu_hashes[: len(cpu)]
    engine_of(client).core.shutdown()


async def test_a_salted_prompts_events_carry_the_salt_as_block_zeros_extra_keys(make_client):
    offload = parse_offloading_config({"cpu_bytes_to_use": "32M", "self_describing_kv_events": True})
    client = await events_client(make_client, engine={"offload": offload})
    ws = await client.ws_connect("/v1/kv_events")
    assert (await client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "tenant-a"})).status == 200
    ids = await prompt_ids(client, CHAT)
    n_full = len(ids) // 16
    msgs = await collect(ws, lambda m: len(stored(m, "CPU")) >= n_full)
    for events in (stored(msgs), stored(msgs, "CPU")):  # the engine's own blocks, then the CPU tier's
        keys = [k for e in events for k in (e["extra_keys"] or [None] * len(e["block_hashes"]))][:n_full]
        assert keys == [["tenant-a"]] + [None] * (n_full - 1)
        # With the extra keys, a router recomputes every hash from the tokens.
        parent, expected = None, []
        for i in range(n_full):
            extra = tuple(keys[i]) if keys[i] else None
            parent = hash_block_tokens(parent, ids[i * 16 : (i + 1) * 16], extra)
            expected.append(block_hash_to_int(parent))
        assert [h for e in events for h in e["block_hashes"]][:n_full] == expected
    # The same prompt unsalted: new blocks (other hashes), whose events have no extra keys.
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    plain = await collect(ws, lambda m: sum(len(e["block_hashes"]) for e in stored(m)) >= n_full)
    assert all(e["extra_keys"] is None for e in stored(plain))
    engine_of(client).core.shutdown()


async def test_since_replays_and_too_old_gets_a_gap(make_client):
    client = await events_client(make_client)
    for i in range(3):
        body = {**CHAT, "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * 20}]}
        await client.post("/v1/chat/completions", json=body)
    publisher = client.app[__import__("server.state", fromlist=["STATE"]).STATE].kv_events
    last = publisher.last_seq
    assert last >= 2
    ws = await client.ws_connect(f"/v1/kv_events?since={last - 1}")
    got = [await receive(ws), await receive(ws)]
    assert [m["seq"] for m in got] == [last - 1, last]
    publisher._ring.popleft()  # simulate the ring having moved on past seq 0
    ws2 = await client.ws_connect("/v1/kv_events?since=0")
    first = await receive(ws2)
    assert first["type"] == "gap" and first["missed_from_seq"] == 0
    assert (await client.get("/v1/kv_events?since=abc")).status == 400


async def test_snapshot_describes_what_is_held_now(make_client):
    client = await events_client(make_client)
    await client.post("/v1/chat/completions", json=CHAT)
    ids = await prompt_ids(client, CHAT)
    ws = await client.ws_connect("/v1/kv_events?snapshot=1")
    snap = await receive(ws)
    assert snap["snapshot"] is True
    events = [e for e in snap["events"] if e["type"] == "BlockStored"]
    assert [t for e in events for t in e["token_ids"]][:16] == ids[:16]
    hashes = {h for e in events for h in e["block_hashes"]}
    assert all(e["parent_block_hash"] is None or e["parent_block_hash"] in hashes for e in events)


async def test_a_stalled_subscriber_gets_a_gap_then_continues():
    from engine.kv_events import AllBlocksCleared
    from server.kv_event_stream import KVEventPublisher

    publisher = KVEventPublisher(queue_size=2)
    stalled = publisher.subscribe()
    reader = publisher.subscribe(None)
    reader.queue = asyncio.Queue(maxsize=100)
    for _ in range(5):  # seq 0..4; the stalled queue holds two
        publisher.publish([AllBlocksCleared()])
    got = [orjson.loads(await stalled.next_message()) for _ in range(3)]
    assert [g.get("seq") for g in got[:2]] == [0, 1]
    assert got[2] == {"type": "gap", "missed_from_seq": 2, "missed_to_seq": 4,
                      "reason": "subscriber queue overflow", "event_version": 1}
    publisher.publish([AllBlocksCleared()])
    assert orjson.loads(await stalled.next_message())["seq"] == 5  # live again
    assert reader.queue.qsize() == 6  # the other subscriber missed nothing


async def test_a_subscriber_that_never_reads_does_not_hold_up_requests(make_client):
    client = await events_client(make_client)
    stalled = await client.ws_connect("/v1/kv_events")  # never reads
    for i in range(4):
        body = {**CHAT, "messages": [{"role": "user", "content": f"Topic {i}: " + "tell me more " * 12}]}
        resp = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), timeout=30)
        assert resp.status == 200
    await stalled.close()


async def test_garbage_frames_close_only_that_socket(make_client):
    client = await events_client(make_client)
    ws = await client.ws_connect("/v1/kv_events")
    await ws.send_str("hello?")  # ignored
    await ws.send_bytes(b"\x00\xff garbage")
    msg = await ws.receive(timeout=5)
    assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    other = await client.ws_connect("/v1/kv_events")
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    assert (await receive(other))["events"]


async def test_auth_by_header_or_query_and_off_means_404(make_client):
    client = await events_client(make_client, server={"api_key": "k3y"})
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await client.ws_connect("/v1/kv_events")
    ws = await client.ws_connect("/v1/kv_events", headers={"Authorization": "Bearer k3y"})
    await ws.close()
    ws = await client.ws_connect("/v1/kv_events?api_key=k3y")
    await ws.close()
    off = await make_client()
    assert (await off.get("/v1/kv_events")).status == 404


async def test_reset_prefix_cache_emits_all_blocks_cleared(make_client):
    client = await events_client(make_client)
    await client.post("/v1/chat/completions", json=CHAT)
    ws = await client.ws_connect("/v1/kv_events")
    resp = await client.post("/reset_prefix_cache")
    assert resp.status == 200 and (await resp.json()) == {"reset": True}
    msgs = await collect(ws, lambda m: any(e["type"] == "AllBlocksCleared" for x in m for e in x["events"]))
    assert msgs
    assert engine_of(client).core.pool.num_cached_blocks == 0


async def test_secondary_tier_events_reach_the_stream_with_medium_fs(make_client, tmp_path):
    offload = parse_offloading_config({
        "cpu_bytes_to_use": "32M",
        "self_describing_kv_events": True,
        "secondary_tiers": [{"type": "fs", "path": str(tmp_path), "capacity_bytes": "64M", "demote_on": "store"}],
    })
    client = await events_client(make_client, engine={"offload": offload})
    ws = await client.ws_connect("/v1/kv_events")
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    ids = await prompt_ids(client, CHAT)
    msgs = await collect(ws, lambda m: len(stored(m, "FS")) >= len(ids) // 16, timeout=20)
    fs = stored(msgs, "FS")
    assert all(e["ownership"] == "0:fs" and e["locality"] == "LOCAL" for e in fs)
    # Demotions are written concurrently and finish in any order: find the prompt's first block
    # among them, and every event must describe a block-aligned piece of the prompt (described
    # from the CPU-tier metadata).
    assert any(e["token_ids"] == ids[:16] for e in fs)
    for e in fs:
        n = len(e["token_ids"])
        assert n and any(e["token_ids"] == ids[i : i + n] for i in range(0, len(ids) - n + 1, 16)), e


async def test_a_closed_subscription_leaves_no_task_and_counts_as_101(make_client):
    from tests.server.test_metrics import scrape, value

    client = await events_client(make_client)
    for _ in range(3):
        ws = await client.ws_connect("/v1/kv_events")
        await asyncio.sleep(0.05)  # the handler waits on its subscription now
        await ws.close()
    route = "/v1/kv_events"
    for _ in range(100):
        samples = await scrape(client)
        if value(samples, "zenserve:http_requests_total", route=route) == 3:
            break
        await asyncio.sleep(0.02)
    assert value(samples, "zenserve:http_requests_total", route=route, status="101") == 3
    assert value(samples, "zenserve:http_requests_total", route=route, status="499") == 0
    pending = [t for t in asyncio.all_tasks() if "next_message" in repr(t.get_coro()) or "_drain_client" in repr(t.get_coro())]
    assert pending == []
