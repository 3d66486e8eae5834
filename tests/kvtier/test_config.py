import dataclasses
import json

import pytest

from kvtier.base import Locality
from kvtier.config import (
    CPU_SPEC,
    TIERING_SPEC,
    OffloadingConfig,
    SecondaryTierConfig,
    parse_offloading_config,
    parse_size,
)

FS_TIER = {"type": "fs", "path": "/var/cache/zenserve-kv", "capacity_bytes": "10G"}
OBJ_TIER = {"type": "obj", "endpoint": "http://127.0.0.1:8333", "bucket": "kv-cache", "capacity_bytes": 1 << 30}


def _parse(**fields):
    return parse_offloading_config({"cpu_bytes_to_use": 1 << 20, **fields})


def test_defaults_from_json_text():
    config = parse_offloading_config('{"cpu_bytes_to_use": 1048576}')
    assert config == OffloadingConfig(cpu_bytes_to_use=1 << 20)
    assert (config.spec_name, config.eviction_policy, config.store_threshold) == (CPU_SPEC, "lru", 0)
    assert (config.max_tracker_size, config.offload_prompt_only, config.self_describing_kv_events) == (
        64_000,
        True,
        False,
    )
    assert (config.lookup_deadline_s, config.secondary_tiers, config.blocks_per_chunk_for(16)) == (10.0, (), 1)


def test_every_key_is_read():
    config = parse_offloading_config(
        json.dumps(
            {
                "spec_name": CPU_SPEC,
                "cpu_bytes_to_use": "2G",
                "blocks_per_chunk": 4,
                "eviction_policy": "arc",
                "store_threshold": 3,
                "max_tracker_size": 10,
                "offload_prompt_only": False,
                "self_describing_kv_events": True,
                "lookup_deadline_s": 2.5,
            }
        )
    )
    assert config == OffloadingConfig(
        cpu_bytes_to_use=2 << 30,
        blocks_per_chunk=4,
        eviction_policy="arc",
        store_threshold=3,
        max_tracker_size=10,
        offload_prompt_only=False,
        self_describing_kv_events=True,
        lookup_deadline_s=2.5,
    )


def test_the_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _parse().store_threshold = 5


# --- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("512K", 512 << 10),
        ("512M", 512 << 20),
        ("8G", 8 << 30),
        ("8gb", 8 << 30),
        ("8GiB", 8 << 30),
        ("1.5G", 3 << 29),
        (" 2 T ", 2 << 40),
        ("100B", 100),
    ],
)
def test_sizes_accept_ints_and_binary_suffixes(text, expected):
    assert parse_size(text, "x") == expected
    assert _parse(cpu_bytes_to_use=text).cpu_bytes_to_use == expected


@pytest.mark.parametrize("bad", ["8X", "G", "-1", "1e9", "", True, 1.5, None, [1]])
def test_unreadable_sizes_name_the_key(bad):
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        _parse(cpu_bytes_to_use=bad)


@pytest.mark.parametrize("bad", [0, -5, "0", "0.1"])
def test_sizes_must_be_positive(bad):
    with pytest.raises(ValueError, match="cpu_bytes_to_use must be positive"):
        _parse(cpu_bytes_to_use=bad)


def test_cpu_bytes_to_use_is_required():
    with pytest.raises(ValueError, match="cpu_bytes_to_use is required"):
        parse_offloading_config({"eviction_policy": "lru"})


# --- structure and types --------------------------------------------------------------------


def test_unknown_keys_are_listed():
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'evction_policy', 'store_treshold'"):
        _parse(evction_policy="arc", store_treshold=2)


@pytest.mark.parametrize("text", ["{", "[1, 2]", '"cpu"', "null"])
def test_the_config_must_be_a_json_object(text):
    with pytest.raises(ValueError, match="JSON"):
        parse_offloading_config(text)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("spec_name", "DiskSpec", "spec_name must be one of CPUOffloadingSpec, TieringOffloadingSpec"),
        ("eviction_policy", "lfu", "eviction_policy must be one of lru, arc"),
        ("store_threshold", -1, "store_threshold must be at least 0"),
        ("store_threshold", 1.5, "store_threshold must be an integer"),
        ("store_threshold", True, "store_threshold must be an integer"),
        ("max_tracker_size", 0, "max_tracker_size must be at least 1"),
        ("offload_prompt_only", "yes", "offload_prompt_only must be true or false"),
        ("self_describing_kv_events", 1, "self_describing_kv_events must be true or false"),
        ("lookup_deadline_s", 0, "lookup_deadline_s"),
        ("lookup_deadline_s", -1.0, "lookup_deadline_s"),
        ("lookup_deadline_s", "10", "lookup_deadline_s"),
        ("lookup_deadline_s", float("inf"), "lookup_deadline_s"),
        ("block_size", 0, "block_size must be at least 1"),
        ("block_size", 16.0, "block_size must be an integer"),
        ("blocks_per_chunk", 0, "blocks_per_chunk must be at least 1"),
        ("secondary_tiers", {"type": "fs"}, "secondary_tiers must be a list"),
    ],
)
def test_bad_values_name_their_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        _parse(**{key: value})


def test_an_integer_deadline_is_accepted():
    assert _parse(lookup_deadline_s=3).lookup_deadline_s == 3


# --- chunk size ----------------------------------------------------------------------------


def test_block_size_and_blocks_per_chunk_are_exclusive():
    with pytest.raises(ValueError, match="block_size or blocks_per_chunk, not both"):
        _parse(block_size=64, blocks_per_chunk=4)


def test_blocks_per_chunk_for_an_engine_block_size():
    assert _parse(block_size=64).blocks_per_chunk_for(16) == 4
    assert _parse(block_size=16).blocks_per_chunk_for(16) == 1
    assert _parse(blocks_per_chunk=3).blocks_per_chunk_for(16) == 3
    assert _parse().blocks_per_chunk_for(32) == 1


def test_block_size_must_be_a_multiple_of_the_engine_block_size():
    with pytest.raises(ValueError, match=r"block_size \(40\) must be a multiple of the engine block size \(16\)"):
        _parse(block_size=40).blocks_per_chunk_for(16)
    with pytest.raises(ValueError, match="block_size"):
        _parse(block_size=8).blocks_per_chunk_for(16)


def test_num_slots_divides_the_budget_by_the_chunk_size():
    config = parse_offloading_config({"cpu_bytes_to_use": 1000})
    assert config.num_slots(300) == 3
    assert config.num_slots(1000) == 1
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use \(1000 bytes\) is too small for one chunk of 1001 bytes"):
        config.num_slots(1001)
    with pytest.raises(ValueError, match="bytes_per_chunk"):
        config.num_slots(0)


# --- secondary tiers -----------------------------------------------------------------------


def test_secondary_tiers_imply_the_tiering_spec():
    config = _parse(secondary_tiers=[FS_TIER, OBJ_TIER])
    assert config.spec_name == TIERING_SPEC
    fs, obj = config.secondary_tiers
    assert fs == SecondaryTierConfig(type="fs", capacity_bytes=10 << 30, path="/var/cache/zenserve-kv")
    assert obj == SecondaryTierConfig(
        type="obj", capacity_bytes=1 << 30, endpoint="http://127.0.0.1:8333", bucket="kv-cache"
    )
    assert (fs.effective_locality, obj.effective_locality) == (Locality.LOCAL, Locality.REMOTE)
    assert (fs.demote_on, obj.demote_on, obj.prefix, obj.access_key) == ("evict", "evict", "", None)


def test_an_obj_tier_with_every_key():
    tier = {
        **OBJ_TIER,
        "endpoint": "https://s3.example.com",
        "prefix": "replica-a/",
        "access_key": "AK",
        "secret_key": "SK",
        "region": "eu-west-1",
        "locality": "LOCAL",
        "demote_on": "store",
    }
    (obj,) = _parse(secondary_tiers=[tier]).secondary_tiers
    assert (obj.prefix, obj.access_key, obj.secret_key, obj.region) == ("replica-a/", "AK", "SK", "eu-west-1")
    assert (obj.locality, obj.effective_locality, obj.demote_on) == (Locality.LOCAL, Locality.LOCAL, "store")


def test_an_explicit_cpu_spec_with_secondary_tiers_is_an_error():
    with pytest.raises(ValueError, match="secondary_tiers need spec_name 'TieringOffloadingSpec'"):
        _parse(spec_name=CPU_SPEC, secondary_tiers=[FS_TIER])


def test_the_tiering_spec_without_tiers_is_allowed():
    assert _parse(spec_name=TIERING_SPEC).secondary_tiers == ()


def test_the_tiering_spec_rejects_store_threshold():
    with pytest.raises(ValueError, match="store_threshold >= 2 applies to CPUOffloadingSpec only"):
        _parse(secondary_tiers=[FS_TIER], store_threshold=2)


@pytest.mark.parametrize(
    "tier, message",
    [
        ({**FS_TIER, "pth": "/x"}, r"secondary_tiers\[0\]: unknown key\(s\) 'pth'"),
        ({**FS_TIER, "bucket": "kv-cache"}, r"secondary_tiers\[0\]: unknown key\(s\) 'bucket'"),
        ({"path": "/x", "capacity_bytes": 1}, r"secondary_tiers\[0\]\.type must be one of fs, obj"),
        ({**FS_TIER, "type": "p2p"}, r"secondary_tiers\[0\]\.type must be one of fs, obj"),
        ({"type": "fs", "path": "/x"}, r"secondary_tiers\[0\]\.capacity_bytes is required"),
        ({**FS_TIER, "capacity_bytes": "lots"}, r"secondary_tiers\[0\]\.capacity_bytes"),
        ({**FS_TIER, "capacity_bytes": 0}, r"secondary_tiers\[0\]\.capacity_bytes must be positive"),
        ({**FS_TIER, "path": ""}, r"secondary_tiers\[0\]: an fs tier needs a non-empty 'path'"),
        ({"type": "fs", "capacity_bytes": 1}, "needs a non-empty 'path'"),
        ({**FS_TIER, "locality": "NEAR"}, r"secondary_tiers\[0\]\.locality must be one of LOCAL, REMOTE"),
        ({**FS_TIER, "demote_on": "load"}, "demote_on must be one of evict, store"),
        ({**OBJ_TIER, "endpoint": "ftp://host"}, "needs an 'endpoint' http:// or https:// URL"),
        ({**OBJ_TIER, "endpoint": "127.0.0.1:8333"}, "needs an 'endpoint' http:// or https:// URL"),
        ({**OBJ_TIER, "endpoint": "http://"}, "needs an 'endpoint' http:// or https:// URL"),
        ({k: v for k, v in OBJ_TIER.items() if k != "endpoint"}, "needs an 'endpoint'"),
        ({**OBJ_TIER, "bucket": "kv"}, "needs a 'bucket' of 3-63"),
        ({**OBJ_TIER, "bucket": "KV-Cache"}, "needs a 'bucket' of 3-63"),
        ({k: v for k, v in OBJ_TIER.items() if k != "bucket"}, "needs a 'bucket'"),
        ({**OBJ_TIER, "access_key": "AK"}, "give both 'access_key' and 'secret_key', or neither"),
        ({**OBJ_TIER, "region": 5}, "'region' must be a string"),
        ("fs", r"secondary_tiers\[0\] must be an object"),
    ],
)
def test_bad_secondary_tiers_name_the_tier_and_key(tier, message):
    with pytest.raises(ValueError, match=message):
        _parse(secondary_tiers=[tier])


def test_the_index_of_a_bad_tier_is_named():
    with pytest.raises(ValueError, match=r"secondary_tiers\[1\]: unknown key\(s\) 'pth'"):
        _parse(secondary_tiers=[FS_TIER, {**OBJ_TIER, "pth": "/x"}])


def test_two_tiers_may_not_share_a_location():
    with pytest.raises(ValueError, match="share one location: fs:/var/cache/zenserve-kv"):
        _parse(secondary_tiers=[FS_TIER, {**FS_TIER, "capacity_bytes": 5}])
    other_prefix = {**OBJ_TIER, "prefix": "b/"}
    assert len(_parse(secondary_tiers=[OBJ_TIER, other_prefix]).secondary_tiers) == 2


def test_dataclasses_validate_when_built_directly():
    with pytest.raises(ValueError, match="cpu_bytes_to_use must be at least 1"):
        OffloadingConfig(cpu_bytes_to_use=0)
    with pytest.raises(ValueError, match="'path' applies to fs tiers"):
        SecondaryTierConfig(type="obj", capacity_bytes=1, path="/x", endpoint="http://h", bucket="abc")
    with pytest.raises(ValueError, match="secondary_tiers must be a tuple"):
        OffloadingConfig(cpu_bytes_to_use=1, spec_name=TIERING_SPEC, secondary_tiers=[])
