from engine.block_hash import NONE_HASH, block_hash_to_int, hash_block_tokens, hash_full_blocks


def test_chain_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])  # None parent means the seed hash
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4], ("lora-a",)) != a


def test_hash_full_blocks_only_hashes_full_blocks_and_extends_a_chain():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    more = hash_full_blocks(tokens + [10, 11], 4, hashes)
    assert more == [hash_block_tokens(hashes[1], [8, 9, 10, 11])]


def test_hashes_are_reproducible_across_processes():
    # A fixed seed (not a random one): independent servers and routers must agree.
    import hashlib

    assert NONE_HASH == hashlib.sha256(b"vllm-none-hash").digest()


def test_block_hash_to_int_is_the_low_64_bits_big_endian():
    digest = hash_block_tokens(None, [1, 2])
    assert block_hash_to_int(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert 0 <= block_hash_to_int(digest) < 2**64


def test_cache_salt_keys_block_zero_and_so_the_whole_chain():
    tokens = list(range(12))
    plain = hash_full_blocks(tokens, 4)
    salted = hash_full_blocks(tokens, 4, first_block_salt="tenant-a")
    assert salted[0] == hash_block_tokens(None, tokens[:4], ("tenant-a",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[4:8])  # later blocks carry no key of their own
    assert all(a != b for a, b in zip(plain, salted))
    assert hash_full_blocks(tokens, 4, first_block_salt="tenant-a") == salted
    assert all(a != b for a, b in zip(salted, hash_full_blocks(tokens, 4, first_block_salt="tenant-b")))
    # Extending an existing chain never re-salts.
    assert hash_full_blocks(tokens, 4, salted[:1], first_block_salt="tenant-a") == salted[1:]
