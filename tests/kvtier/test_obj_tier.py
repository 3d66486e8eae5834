"""The object-store tier against a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from kvtier.base import MEDIUM_OBJ, Locality, LookupResult, make_offload_key
from kvtier.chunk_format import ModelFingerprint, encode_chunk
from kvtier.obj_tier import ObjTier
from kvtier.secondary_tier import TierStartupError
from tests.s3_server import start_s3_server

FP = ModelFingerprint("test-model", "float32", 2, 2, 8, 16, 16)
PAYLOAD_LEN = 64 * 1024


def key(i: int):
    return make_offload_key(i.to_bytes(32, "big"), 0)


def payload(i: int) -> bytes:
    return bytes([i % 256]) * PAYLOAD_LEN


OBJECT_LEN = len(encode_chunk(FP, key(0), payload(0)))


def make_tier(server, prefix: str, capacity=64 * OBJECT_LEN, **kwargs) -> ObjTier:
    credentials = {"access_key": server.access_key, "secret_key": server.secret_key}
    credentials.update(kwargs.pop("credentials", {}))
    return ObjTier(0, server.endpoint, server.bucket, capacity, FP, prefix=prefix, **credentials, **kwargs)


@pytest.fixture
def prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


async def open_tier(server, prefix, **kwargs) -> ObjTier:
    tier = make_tier(server, prefix, **kwargs)
    await tier.open()
    return tier


async def run_checks(tier: ObjTier) -> None:
    await asyncio.gather(*(check() for check in tier.take_checks()))


async def test_a_written_chunk_reads_back_and_is_a_hit(s3_server, prefix):
    tier = await open_tier(s3_server, prefix)
    assert await tier.write(key(1), payload(1))
    assert tier.lookup(key(1)) is LookupResult.HIT
    assert bytes(await tier.read(key(1))) == payload(1)
    name = f"{prefix}/{FP.digest}/{key(1).hex()[:2]}/{key(1).hex()}.chunk"
    assert s3_server.client().head_object(Bucket=s3_server.bucket, Key=name)["ContentLength"] == OBJECT_LEN
    (stored,) = tier.take_events()
    assert (stored.medium, stored.ownership, stored.locality, stored.removal_expected) == (
        MEDIUM_OBJ, "0:obj", Locality.REMOTE, True)
    await tier.close()


async def test_a_restarted_tier_lists_what_the_bucket_holds(s3_server, prefix):
    tier = await open_tier(s3_server, prefix)
    for i in range(3):
        await tier.write(key(i), payload(i))
    await tier.close()
    again = await open_tier(s3_server, prefix)
    assert [again.lookup(key(i)) for i in range(3)] == [LookupResult.HIT] * 3
    assert bytes(await again.read(key(2))) == payload(2)
    await again.close()


async def test_a_chunk_another_replica_wrote_later_is_found_after_a_retry(s3_server, prefix):
    reader = await open_tier(s3_server, prefix, absent_ttl_s=60.0)
    writer = await open_tier(s3_server, prefix)
    assert reader.lookup(key(1)) is LookupResult.RETRY
    assert reader.lookup(key(1)) is LookupResult.RETRY  # one check in flight, not two
    await run_checks(reader)
    assert reader.lookup(key(1)) is LookupResult.MISS  # absent: remembered for absent_ttl_s
    await writer.write(key(2), payload(2))
    assert reader.lookup(key(2)) is LookupResult.RETRY
    await run_checks(reader)
    assert reader.lookup(key(2)) is LookupResult.HIT
    assert bytes(await reader.read(key(2))) == payload(2)
    await reader.close()
    await writer.close()


async def test_a_corrupt_object_is_a_miss_and_is_deleted(s3_server, prefix):
    tier = await open_tier(s3_server, prefix)
    await tier.write(key(1), payload(1))
    tier.take_events()
    s3 = s3_server.client()
    name = tier.object_key(key(1))
    damaged = bytearray(encode_chunk(FP, key(1), payload(1)))
    damaged[-1] ^= 0xFF
    s3.put_object(Bucket=s3_server.bucket, Key=name, Body=bytes(damaged))
    assert await tier.read(key(1)) is None
    assert tier.lookup(key(1)) is not LookupResult.HIT
    assert "Contents" not in s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=name)
    (removed,) = tier.take_events()
    assert removed.removed and removed.medium == MEDIUM_OBJ
    await tier.close()


async def test_capacity_eviction_deletes_the_lru_object_and_emits_an_obj_removal(s3_server, prefix):
    tier = await open_tier(s3_server, prefix, capacity=2 * OBJECT_LEN)
    await tier.write(key(0), payload(0))
    await tier.write(key(1), payload(1))
    tier.take_events()
    await tier.write(key(2), payload(2))
    stored, removed = tier.take_events()
    assert stored.keys == (key(2),)
    assert (removed.keys, removed.removed, removed.medium, removed.ownership) == ((key(0),), True, MEDIUM_OBJ, "0:obj")
    listing = s3_server.client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/")
    assert sorted(obj["Key"] for obj in listing["Contents"]) == sorted(tier.object_key(key(i)) for i in (1, 2))
    await tier.close()


async def test_large_chunks_are_uploaded_in_parts(s3_server, prefix):
    tier = await open_tier(s3_server, prefix, capacity=1 << 30, multipart_threshold=6 << 20,
                           multipart_part_size=5 << 20)
    big = bytes(range(256)) * (7 << 12)  # 7 MiB: two parts
    assert await tier.write(key(1), big)
    assert bytes(await tier.read(key(1))) == big
    head = s3_server.client().head_object(Bucket=s3_server.bucket, Key=tier.object_key(key(1)))
    assert head["ETag"].strip('"').endswith("-2")  # S3's mark of a two-part upload
    await tier.close()


async def test_credentials_come_from_the_aws_environment(s3_server, prefix, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    tier = await open_tier(s3_server, prefix, credentials={"access_key": None, "secret_key": None})
    assert await tier.write(key(1), payload(1))
    await tier.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bucket": "no-such-bucket"}, "no such bucket"),
        ({"credentials": {"secret_key": "wrong"}}, "access denied"),
    ],
)
async def test_a_missing_bucket_or_refused_credentials_fail_at_start(s3_server, prefix, change, message):
    tier = make_tier(s3_server, prefix, credentials=change.get("credentials", {}), connect_timeout_s=0.5)
    if "bucket" in change:
        tier.bucket = change["bucket"]
    started = time.monotonic()
    with pytest.raises(TierStartupError, match=message):
        await tier.open()
    assert time.monotonic() - started < 10


async def test_a_store_down_at_start_is_an_outage_and_its_bucket_is_listed_once_it_answers(tmp_path, prefix):
    server = start_s3_server(tmp_path)
    try:
        writer = await open_tier(server, prefix)
        assert await writer.write(key(1), payload(1))
        await writer.close()
        server.stop(kill=True)

        started = time.monotonic()
        tier = await open_tier(server, prefix, probe_backoff_s=(0.2, 0.5), connect_timeout_s=0.5)
        assert time.monotonic() - started < 10  # started, not failed and not stuck
        assert not tier.is_healthy and tier.lookup(key(1)) is LookupResult.MISS  # requests recompute
        assert not await tier.write(key(2), payload(2))  # skipped while down

        server.start()
        await _wait_healthy(tier)
        assert tier.lookup(key(1)) is LookupResult.HIT  # listed after the store came back
        assert bytes(await tier.read(key(1))) == payload(1)
        assert await tier.write(key(2), payload(2))
        await tier.close()
    finally:
        server.stop(kill=True)


async def _wait_healthy(tier, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not tier.is_healthy and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert tier.is_healthy


async def test_a_hung_or_crashed_endpoint_is_an_outage_the_tier_recovers_from_by_itself(tmp_path, prefix):
    server = start_s3_server(tmp_path)
    try:
        tier = await open_tier(server, prefix, probe_backoff_s=(0.2, 0.5), connect_timeout_s=0.5, read_timeout_s=0.5)
        await tier.write(key(1), payload(1))

        os.kill(server.process.pid, signal.SIGSTOP)  # hung: connections open, no answer
        try:
            assert await tier.read(key(1)) is None  # a timeout, not a wait forever
            assert tier.stats().extra["healthy"] == 0
            assert tier.lookup(key(1)) is LookupResult.MISS  # requests recompute meanwhile
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        await _wait_healthy(tier)
        assert bytes(await tier.read(key(1))) == payload(1)

        server.stop(kill=True)  # crashed: connection refused
        assert not await tier.write(key(2), payload(2))
        assert not tier.is_healthy
        server.start()
        await _wait_healthy(tier)
        assert tier.lookup(key(1)) is LookupResult.HIT
        assert await tier.write(key(2), payload(2))
        assert bytes(await tier.read(key(2))) == payload(2)
        assert tier.stats().extra["failures"] >= 2
        await tier.close()
    finally:
        server.stop(kill=True)
