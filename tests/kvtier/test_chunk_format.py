"""The chunk object format and the model fingerprint."""

from __future__ import annotations

import dataclasses
import os

import pytest

from kvtier.base import make_offload_key
from kvtier.chunk_format import (
    HEADER_SIZE,
    ChunkFormatError,
    ModelFingerprint,
    chunk_relpath,
    crc32,
    decode_chunk,
    encode_chunk,
    header_prefix_len,
    key_from_hex,
    parse_header,
)

FP = ModelFingerprint("SmolLM2.gguf:LlamaForCausalLM", "float32", 30, 3, 64, 16, 16)
KEY = make_offload_key(bytes(range(32)), 0)
PAYLOAD = os.urandom(4096)


def test_round_trip_returns_the_payload():
    data = encode_chunk(FP, KEY, PAYLOAD)
    assert data[:4] == b"ZKVC"
    assert bytes(decode_chunk(data, FP, KEY)) == PAYLOAD


def test_digest_is_stable_across_processes_and_changes_with_every_field():
    # NOTE: a literal: the digest names directories shared by processes and releases.
    assert FP.digest == ModelFingerprint("SmolLM2.gguf:LlamaForCausalLM", "float32", 30, 3, 64, 16, 16).digest
    assert FP.digest == "622ccbc764422a3c"
    changes = {"model_id": "other", "dtype": "bfloat16", "num_layers": 31, "num_kv_heads": 4, "head_size": 128,
               "block_size": 8, "tokens_per_chunk": 32, "layout": "other/v2"}
    digests = {dataclasses.replace(FP, **{name: value}).digest for name, value in changes.items()}
    assert len(digests) == len(changes) and FP.digest not in digests


def test_fingerprint_rejects_a_chunk_that_is_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of block_size"):
        ModelFingerprint("m", "float32", 1, 1, 1, 16, 24)


def test_header_parses_from_its_prefix_alone():
    data = encode_chunk(FP, KEY, PAYLOAD)
    n = header_prefix_len(data[:HEADER_SIZE])
    header = parse_header(data[:n])
    assert header.key == KEY and header.fingerprint == FP.canonical
    assert header.total_len == len(data)


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda d: d[:-1], "truncated"),
        (lambda d: d[:10], "truncated"),
        (lambda d: d + b"x", "corrupt"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "corrupt"),  # a payload bit
        (lambda d: d[:30] + bytes([d[30] ^ 1]) + d[31:], "corrupt"),  # a key bit (header checksum)
        (lambda d: b"XKVC" + d[4:], "corrupt"),
        (lambda d: d[:4] + (2).to_bytes(2, "big") + d[6:], "foreign"),  # a future format version
    ],
)
def test_damaged_objects_are_rejected_with_a_reason(mangle, reason):
    with pytest.raises(ChunkFormatError) as error:
        decode_chunk(mangle(encode_chunk(FP, KEY, PAYLOAD)), FP, KEY)
    assert error.value.reason == reason


def test_a_chunk_of_another_model_is_foreign():
    other = dataclasses.replace(FP, dtype="bfloat16")
    with pytest.raises(ChunkFormatError) as error:
        decode_chunk(encode_chunk(other, KEY, PAYLOAD), FP, KEY)
    assert error.value.reason == "foreign"


def test_a_chunk_under_another_keys_name_is_corrupt():
    other_key = make_offload_key(bytes(32), 0)
    with pytest.raises(ChunkFormatError, match="another key"):
        decode_chunk(encode_chunk(FP, other_key, PAYLOAD), FP, KEY)


def test_relpath_fans_out_by_the_first_hash_byte_and_names_the_key():
    path = chunk_relpath(KEY)
    hh, name = path.split("/")
    assert hh == "00" and name == KEY.hex() + ".chunk"
    assert key_from_hex(KEY.hex()) == KEY
    assert key_from_hex("zz") is None and key_from_hex("00") is None


def test_the_payload_checksum_is_zlibs_crc32_whichever_library_computes_it():
    # NOTE: chunks written before the faster CRC library must still read (and the reverse).
    import zlib

    data = encode_chunk(FP, KEY, PAYLOAD)
    header = parse_header(data)
    assert header.payload_crc == zlib.crc32(PAYLOAD)
    assert crc32(PAYLOAD) == zlib.crc32(PAYLOAD)
    assert crc32(PAYLOAD[100:], crc32(PAYLOAD[:100])) == zlib.crc32(PAYLOAD)
