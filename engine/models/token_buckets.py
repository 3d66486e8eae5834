"""A step's token count padded up to a bucket, so that the GEMMs of a prefill see few distinct row counts.

oneDNN builds (JIT-compiles) a primitive for each GEMM shape, the row count included, and caches it: on
2 Xeon cores a new row count cost 2.3-2.9 ms for SmolLM2's gate/up projection, and a prefill whose
length the worker had not seen before 10-20 ms more than the next of that length (BENCHMARKS.md). A
server's steps mix a prompt's chunk with the decodes riding along, so their row counts are mostly new,
and a long-lived server meets more of them than oneDNN's cache of 1,024 primitives holds. Padded to
buckets, the row counts are few enough to build every one at start (`token_buckets`).
"""

from __future__ import annotations

# Up to this many tokens a step runs as it is: these are decode batches and short chunks, whose row
# counts are few, and where a padded row would be a large share of the work.
MAX_UNPADDED = 64


def bucket_tokens(tokens: int, coarse: bool = False, unpadded: int = MAX_UNPADDED) -> int:
    """The row count a step of `tokens` tokens runs at: at most about 1/16 more above `unpadded` (at least
    MAX_UNPADDED: a worker whose GEMMs take any row count up to some size raises it), or with `coarse` (a
    quarter as many buckets, for a server that spends memory before speed) about 1/4."""
    if tokens <= max(unpadded, MAX_UNPADDED):
        return tokens
    if coarse:
        step = 32 if tokens <= 128 else 64 if tokens <= 512 else 128 if tokens <= 1024 else 256
    else:
        step = 16 if tokens <= 512 else 32 if tokens <= 1024 else 64 if tokens <= 2048 else 128
    return -(-tokens // step) * step


def token_buckets(max_tokens: int, coarse: bool = False, unpadded: int = MAX_UNPADDED) -> list[int]:
    """Every padded row count of a step of more than `unpadded` (and MAX_UNPADDED) up to `max_tokens` tokens,
    in order."""
    buckets: list[int] = []
    tokens = max(unpadded, MAX_UNPADDED) + 1
    while tokens <= max_tokens:
        buckets.append(bucket_tokens(tokens, coarse, unpadded))
        tokens = buckets[-1] + 1
    return buckets
