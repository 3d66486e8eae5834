"""Steps padded to a bucket of rows (engine/models/token_buckets.py): the bucket arithmetic, and a model
whose steps run padded rows gives its tokens what the unpadded model gives them, cache included."""

from __future__ import annotations

import pytest
import torch

from engine.attention import build_attention_metadata
from engine.kv_cache_spec import make_kv_cache_layout
from engine.models.token_buckets import MAX_UNPADDED, bucket_tokens, token_buckets
from engine.worker.cpu import CPUWorker


def test_a_bucket_holds_the_tokens_with_at_most_a_sixteenth_more():
    assert [bucket_tokens(t) for t in (1, 16, MAX_UNPADDED)] == [1, 16, MAX_UNPADDED]
    previous = 0
    for tokens in range(1, 5000):
        bucket = bucket_tokens(tokens)
        assert bucket >= tokens and bucket >= previous
        assert bucket - tokens < max(16, tokens // 16 + 1), tokens
        previous = bucket
    assert [bucket_tokens(t) for t in (65, 80, 81, 513, 1025, 2049)] == [80, 80, 96, 544, 1088, 2176]


def test_the_buckets_up_to_a_budget_are_every_count_a_step_can_run_at():
    buckets = token_buckets(2048)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 2048
    assert {bucket_tokens(t) for t in range(MAX_UNPADDED + 1, 2049)} == set(buckets)
    assert len(buckets) == 60  # 28 of 16 rows to 512, 16 of 32 to 1,024, 16 of 64 to 2,048
    assert token_buckets(MAX_UNPADDED) == []


def test_coarse_buckets_are_about_a_quarter_as_many():
    assert [bucket_tokens(t, coarse=True) for t in (1, MAX_UNPADDED, 65, 129, 300, 1025)] == [
        1, MAX_UNPADDED, 96, 192, 320, 1280]
    previous = 0
    for tokens in range(1, 5000):
        bucket = bucket_tokens(tokens, coarse=True)
        assert bucket >= tokens and bucket >= previous
        assert bucket - tokens < max(32, tokens // 2 + 1), tokens  # at most a half more (129 -> 192), mostly a quarter
        previous = bucket
    buckets = token_buckets(2048, coarse=True)
    assert {bucket_tokens(t, coarse=True) for t in range(MAX_UNPADDED + 1, 2049)} == set(buckets)
    assert len(buckets) == 16 and buckets[-1] == 2048  # against 60 fine ones


def test_a_worker_whose_gemms_take_any_row_count_up_to_a_size_pads_only_past_it():
    assert [bucket_tokens(t, unpadded=512) for t in (1, 100, 172, 511, 512, 513, 1025)] == [1, 100, 172, 511, 512, 544, 1088]
    assert bucket_tokens(70, unpadded=16) == bucket_tokens(70) == 80  # never below MAX_UNPADDED
    buckets = token_buckets(2048, unpadded=512)
    assert buckets[0] == 544 and buckets == [b for b in token_buckets(2048) if b > 512]
    assert [bucket_tokens(t, coarse=True, unpadded=512) for t in (300, 513)] == [300, 640]
    assert token_buckets(2048, coarse=True, unpadded=512) == [b for b in token_buckets(2048, coarse=True) if b > 512]


def _two_steps(loaded, pad, use_embeds: bool) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step 1: sequence A's 70-token prompt. Step 2: A's first decode beside B's 75-token prompt. Returns
    each step's hidden states and the KV cache after both, with the model padding its rows by `pad`."""
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    g = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(100, 30000, (70,), generator=g)
    prompt_b = torch.randint(100, 30000, (75,), generator=g)
    blocks_a, blocks_b = list(range(5)), list(range(5, 10))
    steps = [
        ([], [(blocks_a, 0, 70)], prompt_a),
        ([(blocks_a, 71)], [(blocks_b, 0, 75)], torch.cat([torch.tensor([4321]), prompt_b])),
    ]
    hidden = []
    loaded.model.pad_tokens = pad
    try:
        with torch.inference_mode():
            for decodes, chunks, ids in steps:
                meta, positions = build_attention_metadata(decodes, chunks, 16, None, torch.device("cpu"))
                embeds = loaded.model.model.embed_tokens(ids) if use_embeds else None
                hidden.append(loaded.model(ids, positions, worker.kv_caches, meta, inputs_embeds=embeds))
    finally:
        loaded.model.pad_tokens = None
    return hidden, worker.kv_caches


@pytest.mark.parametrize("use_embeds", [False, True])
def test_padded_rows_leave_the_tokens_and_the_cache_as_unpadded(smollm_fp32, use_embeds):
    plain_hidden, plain_cache = _two_steps(smollm_fp32, None, use_embeds=False)
    padded_hidden, padded_cache = _two_steps(smollm_fp32, lambda tokens: tokens + 9, use_embeds)
    for plain, padded in zip(plain_hidden, padded_hidden, strict=True):
        assert padded.shape == plain.shape  # the padded rows are dropped from the output
        torch.testing.assert_close(padded, plain, rtol=1e-4, atol=1e-4)
    used = 10 * 16  # the two sequences' ten blocks
    for (k_plain, v_plain), (k_padded, v_padded) in zip(plain_cache, padded_cache, strict=True):
        torch.testing.assert_close(k_padded, k_plain, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v_padded, v_plain, rtol=1e-4, atol=1e-4)
        assert not k_padded[used:].any() and not v_padded[used:].any()  # no padded row was written
