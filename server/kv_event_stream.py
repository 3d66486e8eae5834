"""The KV-event publisher: one batch per engine step, a bounded replay ring, and one bounded
queue per websocket subscriber. A slow subscriber never slows the engine: when its queue is
full it misses batches and is told so by a gap message once it catches up.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from engine.kv_events import KVCacheEvent
from server.kv_event_codec import EVENT_VERSION, encode_batch


def gap_message(missed_from: int, missed_to: int, reason: str) -> bytes:
    return orjson.dumps(
        {"type": "gap", "missed_from_seq": missed_from, "missed_to_seq": missed_to, "reason": reason,
         "event_version": EVENT_VERSION}
    )


@dataclass(eq=False)
class Subscriber:
    queue: asyncio.Queue[bytes]
    missed: tuple[int, int] | None = None  # seq range dropped while the queue was full

    def offer(self, seq: int, message: bytes) -> None:
        if self.missed is not None:
            if self.queue.maxsize - self.queue.qsize() >= 2:
                self.queue.put_nowait(gap_message(*self.missed, reason="subscriber queue overflow"))
                self.missed = None
            else:
                self.missed = (self.missed[0], seq)
                return
        try:
            self.queue.put_nowait(message)
        except asyncio.QueueFull:
            self.missed = (seq, seq)

    async def next_message(self) -> bytes:
        """The next frame to send; a pending gap goes out as soon as the backlog is drained."""
        if self.missed is not None and self.queue.empty():
            gap, self.missed = gap_message(*self.missed, reason="subscriber queue overflow"), None
            return gap
        return await self.queue.get()


class KVEventPublisher:
    def __init__(self, ring_size: int = 1024, queue_size: int = 256, clock: Callable[[], float] = time.time):
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._subscribers: set[Subscriber] = set()
        self._queue_size = queue_size
        self._clock = clock
        self.last_seq = -1
        self.num_events = 0

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Called on the loop thread after each engine step that produced events."""
        if not events:
            return
        self.last_seq += 1
        message = orjson.dumps(encode_batch(self.last_seq, self._clock(), events))
        self._ring.append((self.last_seq, message))
        self.num_events += len(events)
        for sub in self._subscribers:
            sub.offer(self.last_seq, message)

    def subscribe(self, since: int | None = None, snapshot: list[KVCacheEvent] | None = None) -> Subscriber:
        """Register a subscriber, queueing its replay or snapshot first. Runs without awaiting,
        so nothing published can fall between the replay and the live stream."""
        replay: list[bytes] = []
        if snapshot is not None:
            replay.append(orjson.dumps(encode_batch(self.last_seq, self._clock(), snapshot, snapshot=True)))
        elif since is not None:
            oldest = self._ring[0][0] if self._ring else self.last_seq + 1
            if since < oldest:
                replay.append(gap_message(since, oldest - 1, reason="older than the replay ring"))
            replay.extend(m for s, m in self._ring if s >= since)
        sub = Subscriber(asyncio.Queue(maxsize=max(self._queue_size, len(replay) + 1)))
        for message in replay:
            sub.queue.put_nowait(message)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)
