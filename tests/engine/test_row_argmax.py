"""Greedy decoding's one-pass argmax (engine/kernels/row_argmax.cpp) against torch.argmax."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kv_cache_spec import make_kv_cache_layout
from engine.request import SamplingParams
from engine.sampling import Sampler, SamplingRow
from engine.worker import create_worker


@pytest.fixture(scope="module")
def row_argmax(cpu_kernels):
    return kernels.load_row_argmax()


# Vocabulary sizes around the kernel's 16-wide (AVX-512) and 8-wide (AVX2) vectors (a tail, none, shorter
# than one) and SmolLM2's.
@pytest.mark.parametrize("vocab", [1, 5, 8, 9, 16, 17, 49152, 49157])
@pytest.mark.parametrize("rows", [1, 3, 16, 33])
def test_row_argmax_is_torchs_argmax(row_argmax, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    logits[:, ::7] = logits.max()  # ties: the first occurrence wins, whichever vector lane holds it
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


def test_row_argmax_follows_torch_on_nan_and_infinities(row_argmax):
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    logits[0, 40] = float("nan")  # NaN beats every number (in a full vector)
    logits[1, 97] = float("nan")  # ... and in the tail
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")  # all -inf: index 0
    logits[3, 98] = float("inf")  # +inf in the tail beats the vectors' maximum
    logits[4, [10, 98]] = 50.0  # a tie between a vector and the tail (96..99 for 8- and 16-wide): the vector's comes first
    logits[5, [33, 99]] = float("inf")
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


def test_row_argmax_reads_rows_of_a_strided_batch(row_argmax):
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(1))[::2, :150]  # row stride 400
    assert torch.equal(row_argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("vocab", [1, 9, 17, 49152, 49157])
def test_row_argmax_reads_bf16_rows_as_their_float32_copy(row_argmax, vocab):
    # bf16's 8 bits of precision make ties common: the first occurrence must still win.
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).bfloat16()
    logits[:, ::5] = logits.max()
    if vocab > 40:
        logits[1, 30] = float("nan")
        logits[2, vocab - 2] = float("inf")
        logits[3] = float("-inf")
    assert torch.equal(row_argmax(logits), logits.float().argmax(-1))


def test_row_argmax_rejects_what_it_cannot_read(row_argmax):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        row_argmax(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        row_argmax(torch.zeros(8, 2).t())


def test_the_sampler_takes_bf16_logits_as_their_float32_copy(row_argmax):
    # All greedy: the argmax of the bf16 logits as given; a row with a logit bias sends the batch through
    # float32 as before.
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(3)).bfloat16()
    logits[:, ::9] = logits.max()  # ties: the first occurrence wins
    greedy = SamplingRow(SamplingParams(temperature=0.0), [1], [], frozenset(), None)
    biased = SamplingRow(SamplingParams(temperature=0.0, logit_bias=((7, 50.0),)), [1], [], frozenset(), None)
    for sampler in (Sampler(seed=0, row_argmax=row_argmax), Sampler(seed=0)):
        assert torch.equal(sampler(logits, [greedy] * 6).token_ids, logits.float().argmax(-1))
        mixed = sampler(logits, [greedy] * 5 + [biased]).token_ids
        assert mixed[5] == 7 and torch.equal(mixed[:5], logits[:5].float().argmax(-1))


def test_sampler_with_the_kernel_picks_what_torch_picks(row_argmax):
    logits = torch.randn(12, 49152, generator=torch.Generator().manual_seed(2))
    greedy = SamplingRow(SamplingParams(temperature=0.0), [1], [], frozenset(), None)
    random_row = SamplingRow(SamplingParams(temperature=1.0, seed=5), [1], [], frozenset(),
                             torch.Generator().manual_seed(5))
    rows = [greedy] * 11 + [random_row]
    with_kernel = Sampler(seed=0, row_argmax=row_argmax)(logits, rows).token_ids
    rows[-1] = SamplingRow(SamplingParams(temperature=1.0, seed=5), [1], [], frozenset(), torch.Generator().manual_seed(5))
    with_torch = Sampler(seed=0)(logits, rows).token_ids
    assert torch.equal(with_kernel, with_torch)
    assert torch.equal(with_kernel[:11], logits[:11].argmax(-1))


def test_cpu_workers_sample_greedy_rows_on_the_kernel(cpu_kernels, smollm_fp32):
    layout = make_kv_cache_layout(smollm_fp32.arch, 16, smollm_fp32.dtype, 4 * 1024 * 1024)
    worker = create_worker("eager", smollm_fp32.model, layout, smollm_fp32.dtype)
    assert worker.sampler._row_argmax is kernels.load_row_argmax()
