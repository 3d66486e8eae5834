"""The kv-offloading config (`--kv-offloading-config '{...}'`): parsed once, validated, frozen.

Keys (vLLM's `kv_connector_extra_config` names; SEMANTICS §3.2):

| key                       | default             | meaning                                                   |
|---------------------------|---------------------|-----------------------------------------------------------|
| spec_name                 | CPUOffloadingSpec   | or TieringOffloadingSpec (implied by secondary_tiers)     |
| cpu_bytes_to_use          | required            | host bytes of the CPU tier; int or "512M", "8G", "1.5GiB" |
| block_size                | engine block size   | chunk size in tokens; exclusive with blocks_per_chunk     |
| blocks_per_chunk          | 1                   | chunk = this many engine blocks                           |
| eviction_policy           | lru                 | lru or arc                                                |
| store_threshold           | 0                   | >= 2: store a key only after that many lookups (CPU spec) |
| max_tracker_size          | 64000               | keys whose lookups store_threshold counts                 |
| offload_prompt_only       | true                | store prompt chunks only                                  |
| self_describing_kv_events | false               | full BlockStored payloads for offloaded chunks            |
| lookup_deadline_s         | 10.0                | longest a request waits on HIT_PENDING/RETRY, then recomputes |
| secondary_tiers           | []                  | fs / obj tiers behind the CPU tier (below)                |

A secondary tier is `{"type": "fs", "path", "capacity_bytes"}` or `{"type": "obj", "endpoint"
(http/https URL), "bucket", "prefix" = "", "capacity_bytes", "access_key", "secret_key", "region"}`
(absent credentials come from the standard AWS environment variables), each with optional
`"locality"` ("LOCAL" | "REMOTE"; default LOCAL for fs, REMOTE for obj) and `"demote_on"`
("evict": write a chunk through when the CPU tier evicts it, the default; "store": as soon as the
CPU tier has it).

Size strings are binary: K = 1024, M = 1024², G = 1024³, T = 1024⁴ ("8G" = "8GB" = "8GiB").
Unknown keys are errors: a typo must not silently fall back to a default.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvtier.base import Locality
from kvtier.policy import POLICY_NAMES

CPU_SPEC = "CPUOffloadingSpec"
TIERING_SPEC = "TieringOffloadingSpec"
SPEC_NAMES = (CPU_SPEC, TIERING_SPEC)
TIER_TYPES = ("fs", "obj")
DEMOTE_ON = ("evict", "store")

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:I?B)?|B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# S3 bucket naming: 3-63 characters of lowercase letters, digits, dots and hyphens.
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a size string ("4096", "512K", "1.5G", "8GiB"); ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be an integer or a size string like '8G', got {value!r}")
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match is None:
            raise ValueError(f"{name}: cannot read {value!r} as a size (examples: 1073741824, '512M', '8G')")
        number, unit = match.groups()
        value = int(float(number) * _SIZE_UNITS[unit.upper() if unit else None])
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


@dataclass(frozen=True)
class SecondaryTierConfig:
    """One tier behind the CPU tier; `fs` uses path, `obj` uses endpoint/bucket/prefix/credentials."""

    type: str  # "fs" | "obj"
    capacity_bytes: int
    path: str | None = None  # fs
    endpoint: str | None = None  # obj: http(s)://host[:port]
    bucket: str | None = None  # obj
    prefix: str = ""  # obj: key prefix inside the bucket
    access_key: str | None = None  # obj: None -> AWS_ACCESS_KEY_ID
    secret_key: str | None = None  # obj: None -> AWS_SECRET_ACCESS_KEY
    region: str | None = None  # obj: None -> AWS_DEFAULT_REGION or the client's default
    locality: Locality | None = None  # None: LOCAL for fs, REMOTE for obj (see effective_locality)
    demote_on: str = "evict"

    def __post_init__(self) -> None:
        if self.type not in TIER_TYPES:
            raise ValueError(f"secondary tier type must be one of {', '.join(TIER_TYPES)}, got {self.type!r}")
        _check_int(self.capacity_bytes, "capacity_bytes", minimum=1)
        if self.demote_on not in DEMOTE_ON:
            raise ValueError(f"demote_on must be one of {', '.join(DEMOTE_ON)}, got {self.demote_on!r}")
        if self.locality is not None and not isinstance(self.locality, Locality):
            raise ValueError(f"locality must be a Locality, got {self.locality!r}")
        if self.type == "fs":
            if not isinstance(self.path, str) or not self.path:
                raise ValueError("an fs tier needs a non-empty 'path'")
            for key in ("endpoint", "bucket", "access_key", "secret_key", "region"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key!r} applies to obj tiers, not fs")
            if self.prefix:
                raise ValueError("'prefix' applies to obj tiers, not fs")
            return
        if self.path is not None:
            raise ValueError("'path' applies to fs tiers, not obj")
        url = urlsplit(self.endpoint) if isinstance(self.endpoint, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"an obj tier needs an 'endpoint' http:// or https:// URL, got {self.endpoint!r}")
        if not isinstance(self.bucket, str) or not _BUCKET_RE.fullmatch(self.bucket):
            raise ValueError(
                f"an obj tier needs a 'bucket' of 3-63 lowercase letters, digits, '.' or '-', got {self.bucket!r}"
            )
        for key in ("prefix", "access_key", "secret_key", "region"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{key!r} must be a string, got {value!r}")
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("give both 'access_key' and 'secret_key', or neither (to use the AWS environment)")

    @property
    def effective_locality(self) -> Locality:
        if self.locality is not None:
            return self.locality
        return Locality.LOCAL if self.type == "fs" else Locality.REMOTE

    @property
    def location(self) -> str:
        """Where the tier keeps its data; two tiers must not share one."""
        if self.type == "fs":
            return f"fs:{self.path}"
        return f"obj:{self.endpoint}/{self.bucket}/{self.prefix}"


@dataclass(frozen=True)
class OffloadingConfig:
    cpu_bytes_to_use: int
    spec_name: str = CPU_SPEC
    block_size: int | None = None  # tokens per chunk; None: blocks_per_chunk engine blocks
    blocks_per_chunk: int | None = None  # None: 1 unless block_size is set
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    offload_prompt_only: bool = True
    self_describing_kv_events: bool = False
    lookup_deadline_s: float = 10.0
    secondary_tiers: tuple[SecondaryTierConfig, ...] = ()

    def __post_init__(self) -> None:
        if self.spec_name not in SPEC_NAMES:
            raise ValueError(f"spec_name must be one of {', '.join(SPEC_NAMES)}, got {self.spec_name!r}")
        _check_int(self.cpu_bytes_to_use, "cpu_bytes_to_use", minimum=1)
        if self.block_size is not None and self.blocks_per_chunk is not None:
            raise ValueError("give block_size or blocks_per_chunk, not both")
        if self.block_size is not None:
            _check_int(self.block_size, "block_size", minimum=1)
        if self.blocks_per_chunk is not None:
            _check_int(self.blocks_per_chunk, "blocks_per_chunk", minimum=1)
        if self.eviction_policy not in POLICY_NAMES:
            raise ValueError(
                f"eviction_policy must be one of {', '.join(POLICY_NAMES)}, got {self.eviction_policy!r}"
            )
        _check_int(self.store_threshold, "store_threshold", minimum=0)
        _check_int(self.max_tracker_size, "max_tracker_size", minimum=1)
        for name in ("offload_prompt_only", "self_describing_kv_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        deadline = self.lookup_deadline_s
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not (0 < deadline < math.inf):
            raise ValueError(f"lookup_deadline_s must be a positive number of seconds, got {deadline!r}")
        if not isinstance(self.secondary_tiers, tuple):
            raise ValueError("secondary_tiers must be a tuple of SecondaryTierConfig")
        if self.secondary_tiers and self.spec_name != TIERING_SPEC:
            raise ValueError(f"secondary_tiers need spec_name {TIERING_SPEC!r}, got {self.spec_name!r}")
        if self.spec_name == TIERING_SPEC and self.store_threshold >= 2:
            raise ValueError(f"store_threshold >= 2 applies to {CPU_SPEC} only")
        locations = [tier.location for tier in self.secondary_tiers]
        duplicates = sorted({loc for loc in locations if locations.count(loc) > 1})
        if duplicates:
            raise ValueError(f"two secondary tiers share one location: {', '.join(duplicates)}")

    def blocks_per_chunk_for(self, engine_block_size: int) -> int:
        """Engine blocks per offloaded chunk, checking block_size against the engine's."""
        if engine_block_size < 1:
            raise ValueError(f"engine block size must be positive, got {engine_block_size}")
        if self.block_size is None:
            return 1 if self.blocks_per_chunk is None else self.blocks_per_chunk
        if self.block_size % engine_block_size:
            raise ValueError(
                f"block_size ({self.block_size}) must be a multiple of the engine block size ({engine_block_size})"
            )
        return self.block_size // engine_block_size

    def num_slots(self, bytes_per_chunk: int) -> int:
        """How many chunks of `bytes_per_chunk` bytes the CPU tier holds."""
        if bytes_per_chunk < 1:
            raise ValueError(f"bytes_per_chunk must be positive, got {bytes_per_chunk}")
        num_slots = self.cpu_bytes_to_use // bytes_per_chunk
        if num_slots < 1:
            raise ValueError(
                f"cpu_bytes_to_use ({self.cpu_bytes_to_use} bytes) is too small for one chunk"
                f" of {bytes_per_chunk} bytes"
            )
        return num_slots


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_keys(raw: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(allowed)}")


_CONFIG_KEYS = (
    "spec_name",
    "cpu_bytes_to_use",
    "block_size",
    "blocks_per_chunk",
    "eviction_policy",
    "store_threshold",
    "max_tracker_size",
    "offload_prompt_only",
    "self_describing_kv_events",
    "lookup_deadline_s",
    "secondary_tiers",
)
_TIER_KEYS = {
    "fs": ("type", "path", "capacity_bytes", "locality", "demote_on"),
    "obj": (
        "type",
        "endpoint",
        "bucket",
        "prefix",
        "capacity_bytes",
        "access_key",
        "secret_key",
        "region",
        "locality",
        "demote_on",
    ),
}


def _parse_tier(raw: Any, index: int) -> SecondaryTierConfig:
    where = f"secondary_tiers[{index}]"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be an object, got {raw!r}")
    tier_type = raw.get("type")
    if tier_type not in TIER_TYPES:
        raise ValueError(f"{where}.type must be one of {', '.join(TIER_TYPES)}, got {tier_type!r}")
    _check_keys(raw, _TIER_KEYS[tier_type], where)
    if "capacity_bytes" not in raw:
        raise ValueError(f"{where}.capacity_bytes is required")
    fields = dict(raw)
    fields["capacity_bytes"] = parse_size(raw["capacity_bytes"], f"{where}.capacity_bytes")
    if "locality" in raw:
        names = [locality.value for locality in Locality]
        if raw["locality"] not in names:
            raise ValueError(f"{where}.locality must be one of {', '.join(names)}, got {raw['locality']!r}")
        fields["locality"] = Locality(raw["locality"])
    try:
        return SecondaryTierConfig(**fields)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def parse_offloading_config(text_or_dict: str | Mapping[str, Any]) -> OffloadingConfig:
    """An OffloadingConfig from the JSON text (or the already-decoded object) users pass.

    `secondary_tiers` without a `spec_name` implies TieringOffloadingSpec; with an explicit
    CPUOffloadingSpec it is an error.
    """
    raw: Any = text_or_dict
    if isinstance(text_or_dict, str):
        try:
            raw = json.loads(text_or_dict)
        except json.JSONDecodeError as error:
            raise ValueError(f"kv-offloading config is not valid JSON: {error}") from None
    if not isinstance(raw, Mapping):
        raise ValueError(f"kv-offloading config must be a JSON object, got {type(raw).__name__}")
    _check_keys(raw, _CONFIG_KEYS, "kv-offloading config")
    if "cpu_bytes_to_use" not in raw:
        raise ValueError("kv-offloading config: cpu_bytes_to_use is required")
    fields = dict(raw)
    fields["cpu_bytes_to_use"] = parse_size(raw["cpu_bytes_to_use"], "cpu_bytes_to_use")
    tiers = raw.get("secondary_tiers", [])
    if not isinstance(tiers, list):
        raise ValueError(f"secondary_tiers must be a list, got {tiers!r}")
    fields["secondary_tiers"] = tuple(_parse_tier(tier, i) for i, tier in enumerate(tiers))
    if tiers and "spec_name" not in raw:
        fields["spec_name"] = TIERING_SPEC
    return OffloadingConfig(**fields)
