"""Decode-only steps replayed from CUDA graphs, one per (batch, context) bucket.

Eager PyTorch launches each of a decode step's ~1,200 small kernels (SmolLM2-135M: 30 layers) from
Python: on an H200 that took 15-26 ms a step at batch 1, against 2.6 ms replayed from a graph, which
launches them all at once. Each bucket holds one int64 input buffer (token
ids, context lengths, the block table) in which rows past the step's decodes are padding: context 1
in a scratch block that no sequence owns, so they write and read nothing real. The attention metadata
is derived from that buffer inside the graph (engine.attention.decode_context_slots), so a step copies
one buffer to the device and replays. The engine's warm-up captures the buckets of contexts up to
PREPARED_CONTEXTS positions (`prepare`); any other bucket is captured when first needed.

Off a GPU the same padded forward runs eagerly (`capture=False`): tests check the padding there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import AttentionMetadata, decode_context_slots

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BUCKET = 256  # contexts are bucketed to powers of two from here
# The gathered context of the largest bucket (batch x context positions): larger steps run eagerly.
# 2^20 positions of SmolLM2's 3 KV heads of 64 are 384 MiB of bf16 keys (and as much for values).
MAX_BUCKET_POSITIONS = 1 << 20
# Contexts whose buckets are captured before serving (longer ones on first use): chats mostly fit.
PREPARED_CONTEXTS = 1024


@dataclass
class _Bucket:
    batch: int
    context: int  # positions, a multiple of the block size
    inputs: torch.Tensor  # [batch * (2 + context / block_size)] int64 on the device
    staging: torch.Tensor  # the same on the host (pinned where the device is a GPU)
    hidden: torch.Tensor | None = None  # [batch, hidden]: the captured forward's output
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 scratch_block: int, sliding_window: int, device: torch.device, capture: bool = True):
        """`kv_caches`: the worker's caches including `scratch_block`, which the padded rows use."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sliding_window = sliding_window
        self.device = device
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.replays = 0  # steps served from a bucket, for tests and logs
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # one memory pool for all graphs

    def bucket_for(self, num_decodes: int, max_context: int) -> tuple[int, int] | None:
        """The (batch, context) bucket of a decode-only step; None: it runs eagerly."""
        batch = next((b for b in BATCH_BUCKETS if b >= num_decodes), None)
        context = max(MIN_CONTEXT_BUCKET, 1 << (max_context - 1).bit_length())
        context = -(-context // self.block_size) * self.block_size
        if batch is None or batch * context > MAX_BUCKET_POSITIONS:
            return None
        return batch, context

    def prepare(self, max_batch: int, max_context: int) -> int:
        """Capture the buckets of up to `max_batch` decodes and min(`max_context`, PREPARED_CONTEXTS)
        positions, the largest first (its memory pool then serves the smaller ones). Returns how many."""
        longest = self.bucket_for(1, min(max_context, PREPARED_CONTEXTS))
        assert longest is not None
        keys = {self.bucket_for(batch, context)
                for batch in range(1, max_batch + 1)
                for context in range(MIN_CONTEXT_BUCKET, longest[1] + 1, MIN_CONTEXT_BUCKET)}
        new = sorted((k for k in keys if k is not None and k not in self.buckets), key=lambda k: (-k[1], -k[0]))
        for key in new:
            self._new_bucket(*key)
        return len(new)

    def run(self, key: tuple[int, int], decodes: list[tuple[list[int], int]], token_ids: list[int]) -> torch.Tensor:
        """Hidden states [D, hidden] of the decodes ((block_ids, context_len) each, with its token),
        valid until the next call."""
        bucket = self.buckets.get(key) or self._new_bucket(*key)
        self._stage(bucket, decodes, token_ids)
        bucket.inputs.copy_(bucket.staging, non_blocking=True)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.hidden = self._forward(bucket)
        self.replays += 1
        assert bucket.hidden is not None
        return bucket.hidden[: len(decodes)]

    def _stage(self, bucket: _Bucket, decodes: list[tuple[list[int], int]], token_ids: list[int]) -> None:
        b, blocks = bucket.batch, bucket.context // self.block_size
        staged = bucket.staging.numpy()
        ids, lens, table = staged[:b], staged[b : 2 * b], staged[2 * b :].reshape(b, blocks)
        ids[:] = 0
        ids[: len(token_ids)] = token_ids
        lens[:] = 1  # padding: position 0 of the scratch block
        table[:] = self.scratch_block
        for row, (block_ids, context_len) in enumerate(decodes):
            n = -(-context_len // self.block_size)
            lens[row] = context_len
            table[row, :n] = block_ids[:n]

    def _new_bucket(self, batch: int, context: int) -> _Bucket:
        size = batch * (2 + context // self.block_size)
        inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
        staging = torch.zeros(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        bucket = self.buckets[(batch, context)] = _Bucket(batch, context, inputs, staging)
        self._stage(bucket, [], [])  # all padding: warm-up and capture touch the scratch block only
        bucket.inputs.copy_(bucket.staging)
        if self.capture:
            self._capture(bucket)
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        # Warm up on a side stream first (lazy initializations, cuBLAS workspaces), as torch's docs ask.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            bucket.hidden = self._forward(bucket)
        bucket.graph = graph
        log.info("captured a CUDA graph for decode steps of %d sequences, contexts up to %d", bucket.batch,
                 bucket.context)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        b, blocks = bucket.batch, bucket.context // self.block_size
        ids, lens = bucket.inputs[:b], bucket.inputs[b : 2 * b]
        table = bucket.inputs[2 * b :].view(b, blocks)
        slots, valid, write = decode_context_slots(table, lens, self.block_size, self.sliding_window, bucket.context)
        meta = AttentionMetadata(
            slot_mapping=write,
            num_decodes=b,
            decode_slots=slots,
            decode_mask=valid[:, None, None, :],
            prefills=(),
            decode_context_lens=lens,
            sliding_window=self.sliding_window,
        )
        return self.model(ids, lens - 1, self.kv_caches, meta)
