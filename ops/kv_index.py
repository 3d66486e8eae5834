"""Which replica holds the longest prefix of a prompt: an index fed by zenserve KV-event streams.

The building block for prefix-aware routing. `KVIndex` is pure (no I/O): it applies event messages
from GET /v1/kv_events and scores prompts by recomputing their block hash chain with
`engine.block_hash`. `KVIndexSubscriber` keeps it fed from one websocket per server. The CLI:

    python -m ops.kv_index --server http://127.0.0.1:8000 --server http://127.0.0.1:8001 --query "..."

prints each server's matched blocks and the best server as JSON; without --query it follows the
streams and logs index stats.

Consumer rules (SEMANTICS.md §2.7), as applied here:

| Message / event     | Effect on the publishing server's entries                                     |
|---------------------|-------------------------------------------------------------------------------|
| BlockStored         | +1 per (hash, medium): repeated announcements are reference-counted           |
| BlockRemoved        | -1 per (hash, medium), dropped at 0; removals of unknown hashes are ignored   |
| AllBlocksCleared    | every entry of that server goes, in every medium                              |
| snapshot message    | replaces all of that server's entries; the view is in sync again              |
| gap / seq jump      | view possibly stale: the subscriber reconnects with ?snapshot=1               |
| seq already applied | ignored (a replay must not count twice)                                       |

A prompt's score on a server: the longest run of its full blocks, from block 0, that the server
holds in any medium, each block weighted by the best medium holding it (TIER_WEIGHTS):

| medium  | weight | what it is                                        |
|---------|--------|---------------------------------------------------|
| GPU     | 1.0    | the engine's own KV pool (also on a CPU engine)   |
| CPU     | 0.8    | the CPU offload tier                              |
| FS      | 0.5    | filesystem secondary tier                         |
| STORAGE | 0.5    | vLLM >= 0.27's one name for the secondary tiers   |
| OBJ     | 0.3    | object-store secondary tier                       |
| other   | 0.3    | an unknown medium still holds the block           |

Not covered: prompts whose block hashes carry extra keys other than a cache_salt (LoRA, images) and
data-parallel ranks (zenserve publishes data_parallel_rank null).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
import orjson
from yarl import URL

from engine.block_hash import block_hash_to_int, hash_full_blocks

log = logging.getLogger("ops.kv_index")

# How much a block held on a medium is worth to a request routed there (the table above).
TIER_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "FS": 0.5, "STORAGE": 0.5, "OBJ": 0.3}
# NOTE: a medium we don't know still holds the block (the prefix continues) at the lowest weight.
UNKNOWN_TIER_WEIGHT = 0.3
DEFAULT_MEDIUM = "GPU"  # events with medium null come from the engine pool (vLLM's default)


class ServerScore(NamedTuple):
    server: str
    matched_blocks: int  # leading full blocks of the prompt the server holds, in any medium
    weighted_score: float  # those blocks, each weighted by its best medium (in blocks)


@dataclass(frozen=True)
class ServerStats:
    num_blocks: dict[str, int]  # medium -> distinct hashes held there
    is_synced: bool
    last_seq: int | None


def prompt_block_hashes(token_ids: Sequence[int], block_size: int = 16, cache_salt: str | None = None) -> list[int]:
    """The wire (64-bit int) hashes of the prompt's full blocks, chained from block 0 (salted as the
    request's `cache_salt` salts them)."""
    return [block_hash_to_int(h) for h in hash_full_blocks(token_ids, block_size, first_block_salt=cache_salt)]


class KVIndex:
    """hash -> {server: {medium: refcount}}, plus per-server sync state. Pure: no I/O, no clock."""

    def __init__(self, block_size: int = 16, tier_weights: Mapping[str, float] = TIER_WEIGHTS):
        self.block_size = block_size
        self.tier_weights = dict(tier_weights)
        self._holders: dict[int, dict[str, dict[str, int]]] = {}
        self._server_hashes: dict[str, set[int]] = {}  # reverse map: clear a server without a scan
        self._last_seq: dict[str, int] = {}
        self._synced: set[str] = set()
        self.num_block_size_mismatches = 0  # stored events whose block_size isn't ours: they never match

    # ---- servers ---------------------------------------------------------------------------------
    @property
    def servers(self) -> list[str]:
        return list(self._server_hashes)

    def add_server(self, server: str) -> None:
        """Known with no entries (scored 0) until its events arrive."""
        self._server_hashes.setdefault(server, set())

    def is_synced(self, server: str) -> bool:
        """A snapshot was applied and nothing was missed since."""
        return server in self._synced

    def mark_stale(self, server: str) -> None:
        """Events may have been missed (gap, disconnect): entries stay, best effort, until a snapshot."""
        self._synced.discard(server)

    # ---- events ----------------------------------------------------------------------------------
    def apply(self, server: str, message: Mapping[str, Any]) -> bool:
        """Apply one stream message from `server`. Returns True when its view needs a resync
        (reconnect with ?snapshot=1)."""
        self.add_server(server)
        if message.get("type") == "gap":
            self.mark_stale(server)
            return True
        seq = message.get("seq")
        last = self._last_seq.get(server)
        if message.get("snapshot"):
            self._clear(server)
            self._apply_events(server, message.get("events", ()))
            self._synced.add(server)
            if seq is not None:
                self._last_seq[server] = seq
            return False
        needs_resync = False
        if seq is not None and last is not None:
            if seq <= last:
                return False  # already applied
            if seq != last + 1:
                self.mark_stale(server)
                needs_resync = True
        self._apply_events(server, message.get("events", ()))
        if seq is not None:
            self._last_seq[server] = seq
        return needs_resync

    def _apply_events(self, server: str, events: Iterable[Mapping[str, Any]]) -> None:
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                if event.get("block_size") not in (None, 0, self.block_size):
                    self.num_block_size_mismatches += 1
                self._store(server, event["block_hashes"], event.get("medium") or DEFAULT_MEDIUM)
            elif kind == "BlockRemoved":
                self._remove(server, event["block_hashes"], event.get("medium") or DEFAULT_MEDIUM)
            elif kind == "AllBlocksCleared":
                self._clear(server)
            # other types: ignored (newer publishers may add some)

    def _store(self, server: str, block_hashes: Iterable[int], medium: str) -> None:
        hashes = self._server_hashes[server]
        for h in block_hashes:
            media = self._holders.setdefault(h, {}).setdefault(server, {})
            media[medium] = media.get(medium, 0) + 1
            hashes.add(h)

    def _remove(self, server: str, block_hashes: Iterable[int], medium: str) -> None:
        for h in block_hashes:
            by_server = self._holders.get(h)
            media = by_server.get(server) if by_server else None
            if not media or medium not in media:
                continue  # never announced to us (placeholder, or stored before we joined)
            media[medium] -= 1
            if media[medium] > 0:
                continue
            del media[medium]
            if not media:
                del by_server[server]
                self._server_hashes[server].discard(h)
                if not by_server:
                    del self._holders[h]

    def _clear(self, server: str) -> None:
        for h in self._server_hashes.get(server, ()):
            by_server = self._holders[h]
            del by_server[server]
            if not by_server:
                del self._holders[h]
        self._server_hashes[server] = set()

    # ---- queries ---------------------------------------------------------------------------------
    def holders(self, block_hash: int) -> dict[str, dict[str, int]]:
        """server -> {medium: refcount} for one hash (a copy)."""
        return {s: dict(m) for s, m in self._holders.get(block_hash, {}).items()}

    def score(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[ServerScore]:
        """Every known server's prefix match for the prompt (sent with `cache_salt`), best first."""
        return self.score_hashes(prompt_block_hashes(token_ids, self.block_size, cache_salt))

    def score_hashes(self, block_hashes: Sequence[int]) -> list[ServerScore]:
        matched = dict.fromkeys(self._server_hashes, 0)
        weighted = dict.fromkeys(self._server_hashes, 0.0)
        live = set(self._server_hashes)  # servers whose run has not broken yet
        for i, h in enumerate(block_hashes):
            by_server = self._holders.get(h, {})
            for server in list(live):
                media = by_server.get(server)
                if not media:
                    live.discard(server)  # the prefix stops at the first missing block
                    continue
                matched[server] = i + 1
                weighted[server] += max(self.tier_weights.get(m, UNKNOWN_TIER_WEIGHT) for m in media)
            if not live:
                break
        scores = [ServerScore(s, matched[s], round(weighted[s], 6)) for s in self._server_hashes]
        return sorted(scores, key=lambda x: (-x.weighted_score, -x.matched_blocks, x.server))

    def best_server(self, token_ids: Sequence[int]) -> str | None:
        """The server with the best weighted prefix match; None when no server holds block 0."""
        scores = self.score(token_ids)
        return scores[0].server if scores and scores[0].matched_blocks > 0 else None

    def stats(self) -> dict[str, ServerStats]:
        out = {}
        for server, hashes in self._server_hashes.items():
            counts: dict[str, int] = {}
            for h in hashes:
                for medium in self._holders[h][server]:
                    counts[medium] = counts.get(medium, 0) + 1
            out[server] = ServerStats(counts, server in self._synced, self._last_seq.get(server))
        return out


# ---- the subscriber ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backoff:
    """Capped exponential reconnect delay with jitter; give up after `max_attempts` failures in a
    row (None: never)."""

    initial_s: float = 0.2
    max_s: float = 10.0
    factor: float = 2.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s or self.factor < 1:
            raise ValueError("need 0 < initial_s <= max_s and factor >= 1")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1 (or None)")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry `attempt` (0-based): between half and all of the capped value."""
        capped = min(self.max_s, self.initial_s * self.factor ** min(attempt, 64))
        return capped * (rng or random).uniform(0.5, 1.0)


# Handshake answers that retrying won't change: bad key, or --kv-events off (404).
_FATAL_STATUSES = frozenset({401, 403, 404})


def events_url(server: str) -> URL:
    """http(s)://host:port[/prefix] -> ws(s)://host:port[/prefix]/v1/kv_events?snapshot=1"""
    url = URL(server)
    scheme = {"http": "ws", "https": "wss"}.get(url.scheme, url.scheme)
    return url.with_scheme(scheme).with_path(url.path.rstrip("/") + "/v1/kv_events").with_query(snapshot="1")


def _http_url(server: str) -> URL:
    url = URL(server)
    return url.with_scheme({"ws": "http", "wss": "https"}.get(url.scheme, url.scheme))


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class KVIndexSubscriber:
    """Follows each server's /v1/kv_events?snapshot=1 into `index`, one task per server. Use as
    `async with`, or `start()` then `close()` (cancels the tasks, closes the session)."""

    def __init__(
        self, index: KVIndex, servers: Sequence[str], *, api_key: str | None = None,
        backoff: Backoff = Backoff(), heartbeat_s: float = 30.0,
    ):
        self.index = index
        self.servers = list(dict.fromkeys(servers))  # base URLs, also the servers' names in the index
        self.api_key = api_key
        self.backoff = backoff
        self.heartbeat_s = heartbeat_s
        self.errors: dict[str, str] = {}  # server -> its last connection error
        self._session: aiohttp.ClientSession | None = None
        self._tasks: dict[str, asyncio.Task] = {}
        self._changed = asyncio.Event()  # set whenever a server's state may have changed

    async def __aenter__(self) -> KVIndexSubscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._session is not None:
            raise RuntimeError("already started")
        self._session = aiohttp.ClientSession(headers=_auth_headers(self.api_key))
        for server in self.servers:
            self.index.add_server(server)
            self._tasks[server] = asyncio.create_task(self._follow(server), name=f"kv-index {server}")

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def has_given_up(self, server: str) -> bool:
        task = self._tasks.get(server)
        return task is not None and task.done()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until every server is in sync (or given up on); True when all are in sync."""

        def settled() -> bool:
            return all(self.index.is_synced(s) or self.has_given_up(s) for s in self.servers)

        try:
            async with asyncio.timeout(timeout):
                while not settled():
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            pass
        return all(self.index.is_synced(s) for s in self.servers)

    def _notify(self) -> None:
        self._changed.set()

    async def _follow(self, server: str) -> None:
        assert self._session is not None
        url = events_url(server)
        failures = 0
        try:
            while True:
                resync = False
                try:
                    async with self._session.ws_connect(url, heartbeat=self.heartbeat_s) as ws:
                        async for msg in ws:
                            if msg.type != aiohttp.WSMsgType.TEXT:
                                continue  # we never ask for binary; CLOSE/ERROR end the iteration
                            failures = 0
                            self.errors.pop(server, None)
                            resync = self._apply(server, msg.data)
                            self._notify()
                            if resync:
                                break
                    if not resync:
                        self.errors[server] = "the stream closed"
                except aiohttp.WSServerHandshakeError as e:
                    if e.status in _FATAL_STATUSES:
                        self.errors[server] = f"handshake refused: HTTP {e.status} {e.message}"
                        log.error("%s: %s; not retrying", server, self.errors[server])
                        return
                    self.errors[server] = f"handshake failed: HTTP {e.status} {e.message}"
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    self.errors[server] = f"{type(e).__name__}: {e}"
                self.index.mark_stale(server)
                self._notify()
                if resync:
                    log.info("%s: missed events; resubscribing with a snapshot", server)
                    await asyncio.sleep(self.backoff.initial_s)  # NOTE: no tight loop if gaps repeat
                    continue
                if self.backoff.max_attempts is not None and failures + 1 >= self.backoff.max_attempts:
                    log.error("%s: giving up after %d failed attempts: %s", server, failures + 1, self.errors[server])
                    return
                delay = self.backoff.delay(failures)
                failures += 1
                log.warning("%s: %s; reconnecting in %.2fs", server, self.errors[server], delay)
                await asyncio.sleep(delay)
        finally:
            self.index.mark_stale(server)
            self._notify()

    def _apply(self, server: str, data: str) -> bool:
        try:
            return self.index.apply(server, orjson.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # NOTE: a frame we can't read may have been part of a batch: resync rather than guess.
            log.warning("%s: unreadable event message (%s); resyncing", server, e)
            self.index.mark_stale(server)
            return True


# ---- the command line ----------------------------------------------------------------------------
async def tokenize(
    session: aiohttp.ClientSession, server: str, text: str, *, chat: bool = False, api_key: str | None = None
) -> list[int]:
    """Token ids as the server would compute them for a completion (prompt form) or for a chat
    with one user message (chat form), via its POST /tokenize."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    base = _http_url(server)
    url = base.with_path(base.path.rstrip("/") + "/tokenize")
    async with session.post(url, json=body, headers=_auth_headers(api_key)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:200]}")
        return list((await resp.json())["tokens"])


async def query(
    servers: Sequence[str], token_ids: Sequence[int], *, api_key: str | None = None, block_size: int = 16,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Subscribe to every server, wait for their snapshots (up to `timeout`), and score the prompt."""
    index = KVIndex(block_size)
    subscriber = KVIndexSubscriber(index, servers, api_key=api_key, backoff=Backoff(initial_s=0.1, max_s=1.0))
    async with subscriber:
        await subscriber.wait_synced(timeout)
        synced = {s: index.is_synced(s) for s in servers}  # closing marks every view stale
    return {
        "num_prompt_tokens": len(token_ids),
        "block_size": block_size,
        "num_prompt_blocks": len(token_ids) // block_size,
        "servers": [
            {"server": s.server, "matched_blocks": s.matched_blocks, "weighted_score": s.weighted_score,
             "synced": synced[s.server],
             "error": None if synced[s.server] else subscriber.errors.get(s.server, "no snapshot in time")}
            for s in index.score(token_ids)
        ],
        "best_server": index.best_server(token_ids),
    }


async def watch(
    servers: Sequence[str], *, api_key: str | None = None, block_size: int = 16, stats_interval: float = 10.0,
    timeout: float | None = None,
) -> None:
    """Follow the streams, logging index stats every `stats_interval` seconds, until `timeout`."""
    index = KVIndex(block_size)
    deadline = None if timeout is None else time.monotonic() + timeout
    async with KVIndexSubscriber(index, servers, api_key=api_key) as subscriber:
        while deadline is None or time.monotonic() < deadline:
            wait = stats_interval if deadline is None else min(stats_interval, deadline - time.monotonic())
            await asyncio.sleep(max(0.0, wait))
            for server, st in index.stats().items():
                log.info("%s: synced=%s last_seq=%s blocks=%s%s", server, st.is_synced, st.last_seq, st.num_blocks,
                         "" if st.is_synced else f" error={subscriber.errors.get(server)}")
            if index.num_block_size_mismatches:
                log.warning("%d stored events had a block size other than %d: pass --block-size",
                            index.num_block_size_mismatches, block_size)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError("token ids are integers separated by commas or spaces") from None
    return ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ops.kv_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", required=True, metavar="URL", help="a zenserve base URL (repeat for each replica)")
    p.add_argument("--api-key", default=os.environ.get("ZENSERVE_API_KEY"), help="the servers' API key (env ZENSERVE_API_KEY)")
    p.add_argument("--block-size", type=int, default=16, help="the servers' --block-size (default: 16)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--query", metavar="TEXT", help="print which server holds the longest prefix of this prompt, and exit")
    what.add_argument("--token-ids", type=_token_ids, metavar="IDS", help="like --query, for a prompt already tokenized: '1,2,3'")
    p.add_argument("--chat", action="store_true", help="--query is one user message of a chat (rendered with the chat template)")
    p.add_argument("--tokenizer-from", metavar="URL", help="server whose POST /tokenize tokenizes --query (default: the first --server)")
    p.add_argument("--timeout", type=float, default=None, help="seconds: query mode waits this long for snapshots (default: 10); watch mode stops after it (default: never)")
    p.add_argument("--stats-interval", type=float, default=10.0, help="watch mode: seconds between stats lines (default: 10)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    return p


async def _main(args: argparse.Namespace) -> int:
    if args.query is None and args.token_ids is None:
        await watch(args.server, api_key=args.api_key, block_size=args.block_size,
                    stats_interval=args.stats_interval, timeout=args.timeout)
        return 0
    timeout = 10.0 if args.timeout is None else args.timeout
    deadline = time.monotonic() + timeout
    token_ids = args.token_ids
    if token_ids is None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            token_ids = await tokenize(session, args.tokenizer_from or args.server[0], args.query,
                                       chat=args.chat, api_key=args.api_key)
    answer = await query(args.server, token_ids, api_key=args.api_key, block_size=args.block_size,
                         timeout=max(0.0, deadline - time.monotonic()))
    sys.stdout.write(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0 if all(s["synced"] for s in answer["servers"]) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
