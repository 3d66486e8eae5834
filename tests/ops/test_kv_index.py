"""ops/kv_index.py: the pure index (ref counts, clears, snapshots, gaps, prefix scoring, tier weights),
the subscriber's reconnects against a scripted stream, and the issue's check: two real servers, and
the index answers which one served a prompt."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.block_hash import block_hash_to_int, hash_block_tokens
from ops.kv_index import Backoff, KVIndex, KVIndexSubscriber, ServerScore, events_url, prompt_block_hashes, watch
from tests.server.conftest import make_client  # noqa: F401 - the fixture, for the two-server tests

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(1000, 1000 + 5 * 16 + 3))  # five full blocks and a partial one
HASHES = prompt_block_hashes(PROMPT)


def batch(seq: int, *events: dict, snapshot: bool = False) -> dict:
    msg = {"seq": seq, "ts": 0.0, "events": list(events), "data_parallel_rank": None, "event_version": 1}
    return {**msg, "snapshot": True} if snapshot else msg


def stored(hashes: list[int], medium: str | None = "GPU", block_size: int = 16) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": block_size, "medium": medium}


def removed(hashes: list[int], medium: str | None = "GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


# ---- prompt hashes -------------------------------------------------------------------------------
def test_prompt_block_hashes_chain_the_full_blocks_as_the_engine_does():
    h0 = hash_block_tokens(None, PROMPT[:16])
    h1 = hash_block_tokens(h0, PROMPT[16:32])
    assert len(HASHES) == 5  # the partial block has no hash
    assert HASHES[:2] == [block_hash_to_int(h0), block_hash_to_int(h1)]
    assert prompt_block_hashes(PROMPT, block_size=32)[0] == block_hash_to_int(hash_block_tokens(None, PROMPT[:32]))


# ---- KVIndex: events -----------------------------------------------------------------------------
def test_repeated_store_announcements_are_ref_counted_per_medium():
    index = KVIndex()
    h = HASHES[0]
    index.apply("s1", batch(0, stored([h]), stored([h], "CPU")))
    index.apply("s1", batch(1, stored([h])))
    assert index.holders(h) == {"s1": {"GPU": 2, "CPU": 1}}
    index.apply("s1", batch(2, removed([h])))
    assert index.holders(h) == {"s1": {"GPU": 1, "CPU": 1}}
    index.apply("s1", batch(3, removed([h])))
    assert index.holders(h) == {"s1": {"CPU": 1}}
    index.apply("s1", batch(4, removed([h], "CPU")))
    assert index.holders(h) == {}
    assert index.stats()["s1"].num_blocks == {}


def test_removals_of_unknown_hashes_or_media_are_ignored():
    index = KVIndex()
    index.apply("s1", batch(0, stored([HASHES[0]])))
    index.apply("s2", batch(0, stored([HASHES[1]])))
    index.apply("s1", batch(1, removed([HASHES[2], HASHES[1]]), removed([HASHES[0]], "CPU")))
    assert index.holders(HASHES[0]) == {"s1": {"GPU": 1}}
    assert index.holders(HASHES[1]) == {"s2": {"GPU": 1}}  # s1 never held it: s2's entry stays
    index.apply("s1", batch(2, removed([HASHES[0]]), stored([HASHES[0]])))  # back to 1 after going to 0
    assert index.holders(HASHES[0]) == {"s1": {"GPU": 1}}


def test_a_null_medium_means_the_engine_pool():
    index = KVIndex()
    index.apply("s1", batch(0, stored([HASHES[0]], medium=None)))
    assert index.holders(HASHES[0]) == {"s1": {"GPU": 1}}


def test_all_blocks_cleared_drops_every_entry_of_that_server_only():
    index = KVIndex()
    index.apply("s1", batch(0, stored(HASHES[:2]), stored(HASHES[:2], "CPU")))
    index.apply("s2", batch(0, stored(HASHES[:1])))
    index.apply("s1", batch(1, CLEARED))
    assert index.holders(HASHES[0]) == {"s2": {"GPU": 1}}
    assert index.holders(HASHES[1]) == {}
    index.apply("s1", batch(2, stored(HASHES[:1], "FS")))  # announcements after the clear count
    assert index.holders(HASHES[0]) == {"s1": {"FS": 1}, "s2": {"GPU": 1}}


def test_a_snapshot_replaces_the_servers_entries_and_syncs_it():
    index = KVIndex()
    index.apply("s1", batch(0, stored(HASHES[:3]), stored(HASHES[:3])))
    index.apply("s2", batch(0, stored(HASHES[:3])))
    assert not index.is_synced("s1")
    assert index.apply("s1", batch(7, stored(HASHES[3:4], "CPU"), snapshot=True)) is False
    assert index.is_synced("s1")
    assert index.holders(HASHES[0]) == {"s2": {"GPU": 1}}
    assert index.holders(HASHES[3]) == {"s1": {"CPU": 1}}
    assert index.stats()["s1"].last_seq == 7
    assert index.apply("s1", batch(8, removed(HASHES[3:4], "CPU"))) is False  # live after the snapshot
    assert index.holders(HASHES[3]) == {}


def test_a_gap_message_marks_the_server_stale_and_asks_for_a_resync():
    index = KVIndex()
    index.apply("s1", batch(3, stored(HASHES[:1]), snapshot=True))
    gap = {"type": "gap", "missed_from_seq": 4, "missed_to_seq": 9, "reason": "subscriber queue overflow"}
    assert index.apply("s1", gap) is True
    assert not index.is_synced("s1")
    assert index.holders(HASHES[0]) == {"s1": {"GPU": 1}}  # kept, best effort, until the next snapshot
    index.apply("s1", batch(12, stored(HASHES[1:2]), snapshot=True))
    assert index.is_synced("s1") and index.holders(HASHES[0]) == {}


def test_a_seq_jump_asks_for_a_resync_and_an_applied_seq_is_not_counted_twice():
    index = KVIndex()
    index.apply("s1", batch(-1, snapshot=True))  # a fresh server's snapshot: nothing published yet
    assert index.apply("s1", batch(0, stored(HASHES[:1]))) is False
    assert index.apply("s1", batch(0, stored(HASHES[:1]))) is False  # replayed
    assert index.holders(HASHES[0]) == {"s1": {"GPU": 1}}
    assert index.is_synced("s1")
    assert index.apply("s1", batch(2, stored(HASHES[1:2]))) is True  # seq 1 went missing
    assert not index.is_synced("s1")
    assert index.holders(HASHES[1]) == {"s1": {"GPU": 1}}


def test_stored_events_of_another_block_size_are_counted():
    index = KVIndex(block_size=16)
    index.apply("s1", batch(0, stored(HASHES[:1], block_size=32), stored(HASHES[1:2], block_size=0)))
    assert index.num_block_size_mismatches == 1  # 0 is a placeholder (offload tier), not a mismatch


# ---- KVIndex: scoring ----------------------------------------------------------------------------
def test_the_prefix_score_stops_at_the_first_missing_block():
    index = KVIndex()
    index.apply("s1", batch(0, stored([HASHES[0], HASHES[1], HASHES[3], HASHES[4]])))
    index.apply("s2", batch(0, stored(HASHES[1:])))  # everything but block 0: no prefix at all
    assert index.score(PROMPT) == [ServerScore("s1", 2, 2.0), ServerScore("s2", 0, 0.0)]
    assert index.best_server(PROMPT) == "s1"


def test_tier_weights_take_the_best_medium_of_each_block():
    index = KVIndex()
    index.apply("s1", batch(0, stored(HASHES[:2], "CPU"), stored(HASHES[:1]), stored(HASHES[2:3], "FS"),
                            stored(HASHES[3:4], "OBJ"), stored(HASHES[4:5], "NVME")))
    assert index.score(PROMPT) == [ServerScore("s1", 5, 2.9)]


def test_servers_rank_by_weighted_score_then_matched_blocks():
    index = KVIndex()
    index.apply("gpu2", batch(0, stored(HASHES[:2])))  # 2 blocks x 1.0
    index.apply("cpu3", batch(0, stored(HASHES[:3], "CPU")))  # 3 blocks x 0.8 = 2.4
    index.apply("obj4", batch(0, stored(HASHES[:4], "OBJ")))  # 4 blocks x 0.3 = 1.2
    index.apply("gpu1", batch(0, stored(HASHES[:1])))
    index.apply("fs2", batch(0, stored(HASHES[:2], "FS")))  # 2 x 0.5 = 1.0: ties gpu1, with more blocks
    assert [s.server for s in index.score(PROMPT)] == ["cpu3", "gpu2", "obj4", "fs2", "gpu1"]
    assert index.best_server(PROMPT) == "cpu3"


def test_best_server_is_none_when_no_server_holds_the_first_block():
    index = KVIndex()
    index.add_server("s1")
    assert index.score(PROMPT) == [ServerScore("s1", 0, 0.0)]
    assert index.best_server(PROMPT) is None
    assert index.best_server(PROMPT[:10]) is None  # no full block


# ---- the subscriber ------------------------------------------------------------------------------
def test_backoff_is_capped_and_validated():
    backoff = Backoff(initial_s=0.1, max_s=1.0, factor=2.0)
    rng = random.Random(0)
    assert all(0.05 <= backoff.delay(0, rng) <= 0.1 for _ in range(20))
    assert all(0.5 <= backoff.delay(1000, rng) <= 1.0 for _ in range(20))
    with pytest.raises(ValueError):
        Backoff(initial_s=2.0, max_s=1.0)
    with pytest.raises(ValueError):
        Backoff(max_attempts=0)


def test_events_url_keeps_a_path_prefix():
    assert str(events_url("http://h:8000")) == "ws://h:8000/v1/kv_events?snapshot=1"
    assert str(events_url("https://h/zen/")) == "wss://h/zen/v1/kv_events?snapshot=1"


async def test_the_subscriber_resubscribes_with_a_snapshot_after_a_gap_and_a_close():
    """A scripted stream: connection 1 sends a snapshot, a live batch and a gap, and stays open (only
    the client can end it); connection 2 a snapshot, then the server closes it; connection 3 a snapshot."""
    seen: list[tuple[str, str | None]] = []
    script = [  # (messages, whether the server closes the socket after them)
        ([batch(4, stored(HASHES[:1]), snapshot=True), batch(5, stored(HASHES[1:2])),
          {"type": "gap", "missed_from_seq": 6, "missed_to_seq": 8, "reason": "subscriber queue overflow"}], False),
        ([batch(9, stored(HASHES[:3]), snapshot=True)], True),
        ([batch(0, stored(HASHES[:4]), snapshot=True)], False),  # the server restarted: seq starts again
    ]

    async def stream(request: web.Request) -> web.WebSocketResponse:
        seen.append((request.query_string, request.headers.get("Authorization")))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        messages, server_closes = script[min(len(seen), len(script)) - 1]
        for m in messages:
            await ws.send_str(orjson.dumps(m).decode())
        if not server_closes:
            await ws.receive()  # until the client goes
        await ws.close()
        return ws

    app = web.Application()
    app.router.add_get("/v1/kv_events", stream)
    async with TestServer(app, host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        index = KVIndex()
        async with KVIndexSubscriber(index, [base], api_key="k3y", backoff=Backoff(initial_s=0.01, max_s=0.05)):
            for _ in range(200):
                if len(seen) == 3 and index.is_synced(base):
                    break
                await asyncio.sleep(0.01)
            assert seen == [("snapshot=1", "Bearer k3y")] * 3
            assert index.score(PROMPT)[0] == ServerScore(base, 4, 4.0)
            assert index.stats()[base].last_seq == 0


async def test_the_subscriber_gives_up_on_a_refused_handshake():
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "bad key"}, status=401)

    app = web.Application()
    app.router.add_get("/v1/kv_events", refuse)
    async with TestServer(app, host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        subscriber = KVIndexSubscriber(KVIndex(), [base], backoff=Backoff(initial_s=0.01))
        async with subscriber:
            assert await asyncio.wait_for(subscriber.wait_synced(timeout=5.0), 6.0) is False
            assert subscriber.has_given_up(base)
            assert "401" in subscriber.errors[base]


async def test_watch_mode_logs_the_index_stats(caplog):
    async def stream(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str(orjson.dumps(batch(2, stored(HASHES[:3]), stored(HASHES[:1], "CPU"), snapshot=True)).decode())
        await ws.receive()
        return ws

    app = web.Application()
    app.router.add_get("/v1/kv_events", stream)
    async with TestServer(app, host="127.0.0.1") as server:
        base = str(server.make_url("")).rstrip("/")
        with caplog.at_level(logging.INFO, logger="ops.kv_index"):
            await asyncio.wait_for(watch([base], stats_interval=0.1, timeout=0.5), 5.0)
    assert f"{base}: synced=True last_seq=2 blocks={{'GPU': 3, 'CPU': 1}}" in caplog.messages


# ---- two real servers ----------------------------------------------------------------------------
async def events_client(make_client, **server):
    return await make_client(server={"kv_events": True, **server}, engine={"enable_kv_events": True})


def base_url(client) -> str:
    return str(client.make_url("/")).rstrip("/")


async def tokenize(client, text: str) -> list[int]:
    return (await (await client.post("/tokenize", json={"prompt": text})).json())["tokens"]


async def complete(client, prompt, headers: dict | None = None, **extra) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    resp = await client.post("/v1/completions", json=body, headers=headers)
    assert resp.status == 200, await resp.text()


async def eventually(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


TEXT_A = "Green tea is picked, withered, steamed or pan fired, rolled and dried. " * 4
TEXT_B = "Espresso is brewed by forcing hot water through finely ground coffee. " * 4


async def test_the_index_answers_the_server_that_served_each_prompt(make_client):
    c1, c2 = await events_client(make_client), await events_client(make_client)
    s1, s2 = base_url(c1), base_url(c2)
    ids_a, ids_b = await tokenize(c1, TEXT_A), await tokenize(c1, TEXT_B)
    assert len(ids_a) >= 48 and len(ids_b) >= 48 and ids_a[:16] != ids_b[:16]
    await complete(c1, ids_a)  # before subscribing: reaches the index through the snapshot
    index = KVIndex()
    async with KVIndexSubscriber(index, [s1, s2]) as subscriber:
        assert await subscriber.wait_synced(timeout=10.0)
        await complete(c2, ids_b)  # after: through the live stream
        await eventually(lambda: index.best_server(ids_b) is not None)
        assert index.best_server(ids_a) == s1
        assert index.best_server(ids_b) == s2
        assert index.score(ids_a) == [ServerScore(s1, len(ids_a) // 16, len(ids_a) // 16), ServerScore(s2, 0, 0.0)]
        shares_a = ids_a[:32] + ids_b[32:]  # A's first two blocks, then B's tokens
        assert index.score(shares_a)[0] == ServerScore(s1, 2, 2.0)
        assert index.score(shares_a)[1] == ServerScore(s2, 0, 0.0)


async def test_a_salted_prompt_is_found_only_under_its_salt(make_client):
    client = await events_client(make_client)
    server = base_url(client)
    ids = await tokenize(client, TEXT_A)
    index = KVIndex()
    async with KVIndexSubscriber(index, [server]) as subscriber:
        assert await subscriber.wait_synced(timeout=10.0)
        await complete(client, ids, cache_salt="tenant-a")
        await eventually(lambda: index.best_server(ids) is not None or index.score(ids, "tenant-a")[0].matched_blocks > 0)
        assert index.score(ids, "tenant-a")[0] == ServerScore(server, len(ids) // 16, len(ids) // 16)
        assert index.score(ids)[0].matched_blocks == 0  # unsalted, the same tokens hash apart
        assert index.score(ids, "tenant-b")[0].matched_blocks == 0


async def test_the_cli_query_prints_the_matched_blocks_and_the_best_server(make_client):
    client = await events_client(make_client, api_key="k3y")
    auth = {"Authorization": "Bearer k3y"}
    await complete(client, TEXT_A, headers=auth)  # a text prompt: the server tokenizes it as /tokenize does
    ids = (await (await client.post("/tokenize", json={"prompt": TEXT_A}, headers=auth)).json())["tokens"]
    server = base_url(client)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ops.kv_index", "--server", server, "--api-key", "k3y", "--query", TEXT_A,
        "--timeout", "20", "--log-level", "warning",
        cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, (out + err).decode()
    answer = orjson.loads(out)
    assert answer["best_server"] == server
    assert answer["num_prompt_tokens"] == len(ids)
    assert answer["servers"] == [{"server": server, "matched_blocks": len(ids) // 16,
                                  "weighted_score": float(len(ids) // 16), "synced": True, "error": None}]

