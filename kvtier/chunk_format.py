"""The on-disk / in-bucket format of one offloaded chunk, and the model fingerprint that guards it.

One object per chunk: a fixed header, the offload key, the fingerprint (canonical JSON) and the
payload (the CPU slot's bytes, `[layer, K|V, tokens, kv heads, head size]` in the KV dtype; an int8
cache's rows, dtype "int8_rowscale", also carry each row's float32 scale after its values).

| offset      | size | field                                                        |
|-------------|------|--------------------------------------------------------------|
| 0           | 4    | magic b"ZKVC"                                                |
| 4           | 2    | format version (1)                                           |
| 6           | 2    | key length K                                                 |
| 8           | 2    | fingerprint length F                                         |
| 10          | 2    | reserved (0)                                                 |
| 12          | 8    | payload length P                                             |
| 20          | 4    | CRC-32 of the payload                                        |
| 24          | 4    | CRC-32 of bytes [0, 24) + key + fingerprint                  |
| 28          | K    | offload key (block hash || group index)                      |
| 28 + K      | F    | fingerprint JSON                                             |
| 28 + K + F  | P    | payload                                                      |

All integers big-endian. The header CRC lets an index rebuild reject a corrupt header without
reading the payload; the payload CRC is checked on every read. CRC-32 detects corruption, not
tampering: a tier's storage is trusted. It is zlib's CRC-32, computed by zlib-ng when installed
(a dependency; folding with carry-less multiply, ~30-50 GB/s here against zlib's ~3 GB/s, which
alone was slower than reading the file from the page cache); both release the GIL on large buffers.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from functools import cached_property

from kvtier.base import OffloadKey

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:  # NOTE: same polynomial and values, only slower
    from zlib import crc32

MAGIC = b"ZKVC"
FORMAT_VERSION = 1
# NOTE: bump when the payload layout changes; it is part of the fingerprint, so old files are
# then foreign and removed instead of misread.
PAYLOAD_LAYOUT = "layer,kv,token,kv_head,head_dim/v1"

_HEADER = struct.Struct(">4sHHHHQII")
HEADER_SIZE = _HEADER.size  # 28
_CRC_OFFSET = 20


class ChunkFormatError(ValueError):
    """An object that is not a valid chunk of this model and key; `reason` says which check failed."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # "truncated" | "corrupt" | "foreign"


@dataclass(frozen=True)
class ModelFingerprint:
    """What must match for two processes to share offloaded KV: the model and the chunk layout.

    `digest` names the directory / key prefix of a tier, so incompatible runs never share files.
    """

    model_id: str  # e.g. the model file's name and architecture
    dtype: str  # KV cache dtype, e.g. "float32", or "int8_rowscale" (engine/kv_quant.py)
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int  # engine tokens per block (= per block hash)
    tokens_per_chunk: int
    layout: str = PAYLOAD_LAYOUT

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tokens_per_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelFingerprint.{name} must be a positive integer, got {value!r}")
        if self.tokens_per_chunk % self.block_size:
            raise ValueError("tokens_per_chunk must be a multiple of block_size")

    @cached_property
    def canonical(self) -> bytes:
        """Sorted-key compact JSON: the same bytes in every process and Python version."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @cached_property
    def digest(self) -> str:
        """16 hex characters of SHA-256 over `canonical`; stable across processes."""
        return hashlib.sha256(self.canonical).hexdigest()[:16]


def key_hex(key: OffloadKey) -> str:
    return key.hex()


def key_from_hex(text: str) -> OffloadKey | None:
    """The key a file or object name encodes, or None if it is not one."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return OffloadKey(raw) if len(raw) > 4 else None


def chunk_relpath(key: OffloadKey) -> str:
    """`<hh>/<key hex>.chunk`: 256 fan-out directories by the first byte of the block hash."""
    text = key_hex(key)
    return f"{text[:2]}/{text}.chunk"


def encode_chunk(fingerprint: ModelFingerprint, key: OffloadKey, payload: bytes | memoryview) -> bytes:
    """Header + key + fingerprint + payload as one bytes object (one copy of the payload).

    Runs a CRC over the payload: call it on a thread for large payloads.
    """
    fp = fingerprint.canonical
    payload_crc = crc32(payload)
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(fp), 0, len(payload), payload_crc, 0)
    header_crc = crc32(fp, crc32(key, crc32(head[:24])))
    head = head[:24] + header_crc.to_bytes(4, "big")
    return b"".join((head, key, fp, payload))


@dataclass(frozen=True)
class ChunkHeader:
    key: OffloadKey
    fingerprint: bytes  # canonical JSON as written
    payload_len: int
    payload_crc: int
    payload_offset: int

    @property
    def total_len(self) -> int:
        return self.payload_offset + self.payload_len


def header_prefix_len(first_bytes: bytes) -> int:
    """How many leading bytes `parse_header` needs, from the first HEADER_SIZE bytes."""
    if len(first_bytes) < HEADER_SIZE:
        raise ChunkFormatError("truncated", f"{len(first_bytes)} bytes, less than a header")
    _, _, key_len, fp_len, *_ = _HEADER.unpack_from(first_bytes)
    return HEADER_SIZE + key_len + fp_len


def parse_header(data: bytes | memoryview) -> ChunkHeader:
    """Check magic, version and the header CRC; `data` holds at least the header, key and fingerprint."""
    if len(data) < HEADER_SIZE:
        raise ChunkFormatError("truncated", f"{len(data)} bytes, less than a header")
    magic, version, key_len, fp_len, _, payload_len, payload_crc, header_crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ChunkFormatError("corrupt", f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise ChunkFormatError("foreign", f"format version {version}, this build reads {FORMAT_VERSION}")
    end = HEADER_SIZE + key_len + fp_len
    if len(data) < end:
        raise ChunkFormatError("truncated", "the header's key and fingerprint are cut short")
    key = bytes(data[HEADER_SIZE : HEADER_SIZE + key_len])
    fp = bytes(data[HEADER_SIZE + key_len : end])
    if crc32(fp, crc32(key, crc32(data[:24]))) != header_crc:
        raise ChunkFormatError("corrupt", "header checksum mismatch")
    return ChunkHeader(OffloadKey(key), fp, payload_len, payload_crc, end)


def check_header(header: ChunkHeader, fingerprint: ModelFingerprint, key: OffloadKey, size: int) -> None:
    """The header belongs to `key` of this model and the object has exactly its length."""
    if header.fingerprint != fingerprint.canonical:
        raise ChunkFormatError("foreign", "written for another model or chunk layout")
    if header.key != key:
        raise ChunkFormatError("corrupt", "the header names another key than the object's name")
    if size < header.total_len:
        raise ChunkFormatError("truncated", f"{size} bytes, the header promises {header.total_len}")
    if size > header.total_len:
        raise ChunkFormatError("corrupt", f"{size} bytes, the header promises {header.total_len}")


def decode_chunk(data: bytes | bytearray | memoryview, fingerprint: ModelFingerprint, key: OffloadKey) -> memoryview:
    """The payload of a whole object, after every check (payload CRC included); a zero-copy view.

    Runs a CRC over the payload: call it on a thread for large payloads.
    """
    header = parse_header(data)
    check_header(header, fingerprint, key, len(data))
    payload = memoryview(data)[header.payload_offset :]
    if crc32(payload) != header.payload_crc:
        raise ChunkFormatError("corrupt", "payload checksum mismatch")
    return payload
