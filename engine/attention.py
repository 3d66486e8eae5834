"""Paged attention over a flattened batch, on torch ops (CPU and CUDA).

The batch is laid out decodes first (one query token each), then prefill chunks. K/V of the
step are written into the paged cache first; then each query attends to its sequence's
cached context, gathered through precomputed slot indices (shared by all layers of a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # row of the chunk's first token in the flattened batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] int64: cache slots of positions 0..context_len-1
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend); None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per step by the worker; read by every attention layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    num_decodes: int  # rows 0..num_decodes-1 are single-token decodes
    decode_slots: torch.Tensor | None  # [D, L] int64: context slots per decode (padded)
    decode_mask: torch.Tensor | None  # [D, 1, 1, L] bool: True where a slot is real context
    prefills: tuple[PrefillChunk, ...]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache, v_cache: [num_slots, KVH, D]; k, v: [T, KVH, D]."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(q)
    num_decodes = meta.num_decodes
    gqa = q.shape[1] != k_cache.shape[1]
    if num_decodes:
        assert meta.decode_slots is not None
        qd = q[:num_decodes].unsqueeze(2)  # [D, H, 1, hd]
        kd = k_cache[meta.decode_slots].transpose(1, 2)  # [D, KVH, L, hd]
        vd = v_cache[meta.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa
        )
        out[:num_decodes] = od.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        qp = q[rows].transpose(0, 1)  # [H, q, hd]
        kp = k_cache[chunk.context_slots].transpose(0, 1)  # [KVH, ctx, hd]
        vp = v_cache[chunk.context_slots].transpose(0, 1)
        op = F.scaled_dot_product_attention(
            qp,
            kp,
            vp,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = op.transpose(0, 1)
    return out


def build_attention_metadata(
    decode_contexts: list[tuple[list[int], int]],
    prefill_chunks: list[tuple[list[int], int, int]],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Slot indices and masks for one step.

    decode_contexts: (block_ids, context_len) per decode; its query is the last position.
    prefill_chunks: (block_ids, start_position, query_len) per chunk.
    Returns the metadata and the positions tensor [T] (decodes first, then chunks).
    """
    positions: list[int] = []
    write_slots: list[int] = []

    def slots_of(block_ids: list[int], start: int, end: int) -> list[int]:
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]

    decode_slots = decode_mask = None
    if decode_contexts:
        max_len = max(ctx for _, ctx in decode_contexts)
        rows, masks = [], []
        for block_ids, ctx in decode_contexts:
            slots = slots_of(block_ids, 0, ctx)
            write_slots.append(slots[-1])
            positions.append(ctx - 1)
            rows.append(slots + [0] * (max_len - ctx))
            lo = max(0, ctx - sliding_window) if sliding_window else 0
            masks.append([lo <= j < ctx for j in range(max_len)])
        decode_slots = torch.tensor(rows, dtype=torch.int64, device=device)
        decode_mask = torch.tensor(masks, dtype=torch.bool, device=device)[:, None, None, :]

    prefills: list[PrefillChunk] = []
    query_start = len(decode_contexts)
    for block_ids, start, qlen in prefill_chunks:
        ctx = start + qlen
        slots = slots_of(block_ids, 0, ctx)
        write_slots.extend(slots[start:])
        positions.extend(range(start, ctx))
        mask = None
        if start > 0 or (sliding_window and ctx > sliding_window):
            q_pos = torch.arange(start, ctx, device=device)[:, None]
            k_pos = torch.arange(ctx, device=device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window:
                mask &= k_pos > q_pos - sliding_window
        prefills.append(
            PrefillChunk(query_start, qlen, torch.tensor(slots, dtype=torch.int64, device=device), mask)
        )
        query_start += qlen

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(write_slots, dtype=torch.int64, device=device),
        num_decodes=len(decode_contexts),
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=tuple(prefills),
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
