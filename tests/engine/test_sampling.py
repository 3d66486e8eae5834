"""Sampler: tiny vocabularies, exact expectations, seeded generators; no model."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

from engine.request import SamplingParams
from engine.sampling import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    make_generator,
)

NEG_INF = float("-inf")


def make_row(
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
    eos_token_ids: frozenset[int] = frozenset(),
    **params: object,
) -> SamplingRow:
    sampling_params = SamplingParams(**params)
    generator = make_generator(sampling_params.seed) if sampling_params.seed is not None else None
    return SamplingRow(sampling_params, prompt_token_ids, output_token_ids, eos_token_ids, generator)


def logits_of(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)  # [1, V]


def frequencies(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(token_ids, minlength=vocab_size).float() / token_ids.numel()


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(5, 32, generator=make_generator(0))
    out = Sampler(seed=0)(logits, [make_row(temperature=0.0)] * 5)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_half_precision_logits_are_sampled_in_float32() -> None:
    logits = torch.randn(4, 32, generator=make_generator(1)).to(torch.bfloat16)
    out = Sampler(seed=0)(logits, [make_row(temperature=0.0, logprobs=1)] * 4)
    assert out.token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


def test_logit_bias_shifts_only_its_rows_tokens_before_greedy_and_random_picks() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    rows = [
        make_row(temperature=0.0, logit_bias={0: -100.0}),  # bans the argmax: the runner-up wins
        make_row(temperature=0.0, logit_bias={3: 5.0}),  # lifts the least likely above the rest
        make_row(temperature=0.0),  # untouched
    ]
    out = Sampler(seed=0)(logits, rows)
    assert out.token_ids.tolist() == [1, 3, 0]
    # A random row draws from the biased distribution: token 2 at +100 takes essentially all the mass.
    draws = Sampler(seed=0)(logits.repeat(200, 1)[:200], [make_row(temperature=1.0, logit_bias={2: 100.0})] * 200)
    assert set(draws.token_ids.tolist()) == {2}
    # Logprobs stay those of the raw logits, as vLLM reports them.
    with_lp = Sampler(seed=0)(logits[:1], [make_row(temperature=0.0, logit_bias={0: -100.0}, logprobs=0)])
    assert with_lp.logprobs[0, 0].item() == pytest.approx(logits[0].log_softmax(-1)[1].item())


@pytest.mark.parametrize("bias", [{-1: 1.0}, {0: 101.0}, {0: float("nan")}])
def test_bad_logit_bias_is_refused(bias) -> None:
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_greedy_row_is_unchanged_when_batched_with_random_rows() -> None:
    # Nearly flat logits: had the greedy row been sampled or filtered, it would drift off the argmax.
    logits = torch.randn(1, 64, generator=make_generator(2)) * 0.01  # [1, V]
    alone = Sampler(seed=0)(logits, [make_row(temperature=0.0)]).token_ids[0]
    others = [
        make_row(temperature=1.5),
        make_row(temperature=0.7, top_k=5, top_p=0.5, seed=3),
        make_row(temperature=1.0, min_p=0.3, output_token_ids=[int(alone)], presence_penalty=2.0),
        make_row(temperature=1.0, min_tokens=4, eos_token_ids=frozenset({int(alone)})),
    ]
    sampler = Sampler(seed=1)
    for step in range(10):
        batch = others[: step % 4] + [make_row(temperature=0.0)] + others[step % 4 :]
        out = sampler(logits.expand(len(batch), -1), batch)
        assert out.token_ids[step % 4] == alone == logits.argmax()


def test_near_zero_temperature_is_greedy() -> None:
    # Dividing by 1e-39 would overflow to inf and softmax to NaN; such rows take the argmax instead.
    logits = torch.randn(4, 32, generator=make_generator(3))
    out = Sampler(seed=0)(logits, [make_row(temperature=1e-39)] * 4)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


# --- seeds ----------------------------------------------------------------------------------------


def test_seeded_row_gives_the_same_tokens_at_any_batch_position() -> None:
    vocab_size = 50
    step_logits = torch.randn(8, vocab_size, generator=make_generator(4)) * 0.5  # [steps, V]
    params = dict(temperature=0.9, top_k=20, seed=1234)
    alone_row, batched_row = make_row(**params), make_row(**params)
    # Position 0 next to one plain row (top_k without a sort), vs position 3 behind rows that switch
    # every filter on (top_k through the top_p sort).
    alone_sampler, batched_sampler = Sampler(seed=0), Sampler(seed=99)
    companions = [
        make_row(temperature=1.0, top_k=3),
        make_row(temperature=0.5, top_p=0.3, min_p=0.1),
        make_row(temperature=1.0, prompt_token_ids=[1, 2], output_token_ids=[3], repetition_penalty=1.5,
                 frequency_penalty=0.5, min_tokens=3, eos_token_ids=frozenset({4})),
    ]
    alone_tokens, batched_tokens = [], []
    for logits in step_logits:
        alone = alone_sampler(torch.stack([logits, logits.flip(0)]), [alone_row, make_row()])
        batch = companions + [batched_row]
        batched = batched_sampler(logits.expand(len(batch), -1), batch)
        alone_tokens.append(int(alone.token_ids[0]))
        batched_tokens.append(int(batched.token_ids[3]))
    assert alone_tokens == batched_tokens
    assert len(set(alone_tokens)) > 2  # really sampled, not collapsed to the argmax


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 16)  # uniform
    draws = {}
    for seed in (1, 2):
        row = make_row(seed=seed)
        draws[seed] = [int(Sampler(seed=0)(logits, [row]).token_ids[0]) for _ in range(200)]
    num_equal = sum(a == b for a, b in zip(draws[1], draws[2]))
    assert num_equal < 40  # independent draws agree ~1/16 of the time (12.5 expected)


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(64, 16)  # 64 uniform rows
    rows = [make_row()] * 64
    first, second, other = Sampler(seed=5), Sampler(seed=5), Sampler(seed=6)
    for _ in range(3):
        a, b, c = first(logits, rows).token_ids, second(logits, rows).token_ids, other(logits, rows).token_ids
        assert a.tolist() == b.tolist()
        assert a.tolist() != c.tolist()


# --- distributions --------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    num_draws = 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])  # [1, 4]
    out = Sampler(seed=0)(logits.expand(num_draws, -1), [make_row(temperature=temperature)] * num_draws)
    expected = (logits[0] / temperature).softmax(dim=-1)
    assert torch.allclose(frequencies(out.token_ids, 4), expected, atol=0.015)  # ~4 sigma


def test_lower_temperature_sharpens() -> None:
    num_draws = 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]]).expand(num_draws, -1)
    sampler = Sampler(seed=0)
    hot = frequencies(sampler(logits, [make_row(temperature=2.0)] * num_draws).token_ids, 4)
    cold = frequencies(sampler(logits, [make_row(temperature=0.25)] * num_draws).token_ids, 4)
    assert cold[0] > 0.85 > 0.45 > hot[0]  # softmax(l/0.25)[0] = 0.87, softmax(l/2)[0] = 0.36


def test_seeded_row_sampling_matches_softmax() -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    row, sampler = make_row(seed=7), Sampler(seed=0)
    draws = torch.tensor([int(sampler(logits, [row]).token_ids[0]) for _ in range(4000)])
    assert torch.allclose(frequencies(draws, 4), logits[0].softmax(dim=-1), atol=0.03)


# --- filters --------------------------------------------------------------------------------------


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(6, 40, generator=make_generator(8))
    out = Sampler(seed=0)(logits, [make_row(temperature=1.5, top_k=1)] * 6)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_samples_only_the_k_most_likely() -> None:
    num_draws = 4000
    logits = logits_of([0.3, 0.25, 0.2, 0.15, 0.1]).expand(num_draws, -1)
    out = Sampler(seed=0)(logits, [make_row(top_k=2)] * num_draws)
    assert frequencies(out.token_ids, 5)[2:].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(frequencies(out.token_ids, 5)[:2], torch.tensor([0.3, 0.25]) / 0.55, atol=0.04)


@pytest.mark.parametrize("top_k", [40, 41, 2**40, 2**63])
def test_a_top_k_past_the_vocabulary_keeps_every_token(top_k) -> None:
    # Any positive top_k is valid, so one of 2**63 must neither overflow the batch's int64 tensor (which
    # failed every request in the step) nor change the draw: the same seed gives what top_k=0 gives.
    logits = torch.randn(3, 40, generator=make_generator(11))
    disabled = Sampler(seed=0)(logits, [make_row(top_k=2), make_row(top_k=0, seed=5), make_row(top_k=0, top_p=0.9, seed=6)])
    large = Sampler(seed=0)(logits, [make_row(top_k=2), make_row(top_k=top_k, seed=5), make_row(top_k=top_k, top_p=0.9, seed=6)])
    assert large.token_ids.tolist() == disabled.token_ids.tolist()


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = torch.randn(8, 40, generator=make_generator(9)) * 0.05  # nearly flat
    out = Sampler(seed=0)(logits, [make_row(temperature=1.0, top_p=1e-9)] * 8)
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_mask_exactly() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05]).expand(4, -1)  # [4, 4]
    top_k = torch.tensor([4, 3, 4, 4])
    top_p = torch.tensor([1.0, 1.0, 0.75, 0.85])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite()
    assert kept.tolist() == [
        [True, True, True, True],  # both off
        [True, True, True, False],  # top_k=3
        [True, True, False, False],  # 0.5 + 0.3 reaches 0.75
        [True, True, True, False],  # 0.8 < 0.85: one more
    ]
    assert torch.equal(apply_top_k_top_p(logits, top_k, top_p)[kept], logits[kept])  # kept values untouched


def test_top_p_stops_at_the_token_that_exactly_reaches_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0]]) * math.log(2)  # probs 1/2, 1/4, 1/8, 1/8: exact in float
    kept = apply_top_k_top_p(logits, torch.tensor([4]), torch.tensor([0.75])).isfinite()
    assert kept.tolist() == [[True, True, False, False]]


def test_top_p_applies_to_the_top_k_renormalized_mass() -> None:
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    # After top_k=2 the pair is [4/7, 3/7]; top_p=0.55 is reached by the first alone (0.4 would not be).
    kept = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.55])).isfinite()
    assert kept.tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(
    "filter_top_k", [apply_top_k, lambda x, k: apply_top_k_top_p(x, k, torch.ones(1))], ids=["topk", "sort"]
)
def test_top_k_keeps_ties_with_the_kth_token(filter_top_k: Callable[..., torch.Tensor]) -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    kept = filter_top_k(logits, torch.tensor([2])).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_top_k_without_sort_masks_exactly_like_the_sorted_path() -> None:
    # A seeded row may take either path depending on its batch; both must give the same bits.
    logits = torch.randn(6, 300, generator=make_generator(13))  # [6, V=300], no ties
    top_k = torch.tensor([1, 7, 50, 299, 300, 1000])  # 300 and 1000: off
    sorted_path = apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(apply_top_k(logits, top_k), sorted_path)
    assert sorted_path.isfinite().sum(dim=-1).tolist() == [1, 7, 50, 299, 300, 300]


def test_min_p_drops_tokens_below_a_fraction_of_the_top_prob() -> None:
    logits = logits_of([0.5, 0.3, 0.15, 0.05]).expand(2, -1)
    filtered = apply_min_p(logits, torch.tensor([0.2, 0.0]))  # threshold 0.1; off
    assert filtered[0, 3] == NEG_INF and filtered.isfinite().sum() == 7
    assert torch.equal(filtered[filtered.isfinite()], logits[filtered.isfinite()])


def test_min_p_applies_before_top_p() -> None:
    # vLLM v1 order: temperature -> min_p -> top_k/top_p. min_p=0.2 drops token 3; the rest
    # renormalize to [0.53, 0.32, 0.16], so top_p=0.82 stops at two tokens. (top_p first keeps three.)
    num_draws = 4000
    logits = logits_of([0.5, 0.3, 0.15, 0.05]).expand(num_draws, -1)
    out = Sampler(seed=0)(logits, [make_row(min_p=0.2, top_p=0.82)] * num_draws)
    freq = frequencies(out.token_ids, 4)
    assert freq[2:].tolist() == [0.0, 0.0] and freq[0] > 0.5 and freq[1] > 0.3


# --- penalties ------------------------------------------------------------------------------------

_LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])  # [1, V=6]
_PROMPT = torch.tensor([[0, 1, 6]])  # 6 = V: padding
_OUTPUT = torch.tensor([[1, 2, 2, 6]])


def _penalized(presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> list[float]:
    penalties = (torch.tensor([presence]), torch.tensor([frequency]), torch.tensor([repetition]))
    return apply_penalties(_LOGITS, _PROMPT, _OUTPUT, *penalties)[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # Seen in prompt or output: 0, 1, 2.
    assert _penalized(repetition=2.0) == [1.0, -2.0, 0.25, 3.0, -2.0, 1.0]


def test_frequency_penalty_subtracts_output_counts() -> None:
    # Output counts: token 1 once, token 2 twice; prompt token 0 does not count.
    assert _penalized(frequency=0.5) == [2.0, -1.5, -0.5, 3.0, -2.0, 1.0]


def test_presence_penalty_subtracts_once_per_output_token() -> None:
    assert _penalized(presence=0.25) == [2.0, -1.25, 0.25, 3.0, -2.0, 1.0]


def test_penalties_combine_repetition_first() -> None:
    assert _penalized(presence=0.25, frequency=0.5, repetition=2.0) == [1.0, -2.75, -1.0, 3.0, -2.0, 1.0]


def test_penalties_apply_per_row_of_a_padded_batch() -> None:
    logits = torch.ones(2, 4)
    output = torch.tensor([[0, 0, 0], [3, 4, 4]])  # 4 = V: padding
    penalized = apply_penalties(
        logits, torch.full((2, 1), 4), output, torch.zeros(2), torch.tensor([1.0, 0.5]), torch.ones(2)
    )
    assert penalized.tolist() == [[-2.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.5]]


@pytest.mark.parametrize(
    ("penalty", "prompt", "output"),
    [
        (dict(presence_penalty=1.0), [], [0]),
        (dict(frequency_penalty=0.3), [], [0, 0]),  # 3.0 - 0.6 < 2.5
        (dict(repetition_penalty=1.5), [0], []),  # the prompt counts for repetition
    ],
)
def test_sampler_applies_penalties_before_choosing(
    penalty: dict[str, float], prompt: list[int], output: list[int]
) -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    plain = make_row(temperature=0.0, prompt_token_ids=prompt, output_token_ids=output)
    penalized = make_row(temperature=0.0, prompt_token_ids=prompt, output_token_ids=output, **penalty)
    assert Sampler(seed=0)(logits, [plain]).token_ids.tolist() == [0]
    assert Sampler(seed=0)(logits, [penalized]).token_ids.tolist() == [1]


def test_sampler_penalizes_each_row_with_its_own_tokens() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0], [0.0, 0.0, 1.0], [2.0, 0.0, 3.0]])
    rows = [
        make_row(temperature=0.0, output_token_ids=[0], presence_penalty=1.0),  # 3 - 1 < 2.5
        make_row(temperature=0.0, output_token_ids=[2]),  # no penalty: keeps its argmax
        make_row(temperature=0.0, output_token_ids=[2, 2], frequency_penalty=0.75),  # 3 - 1.5 < 2
    ]
    assert Sampler(seed=0)(logits, rows).token_ids.tolist() == [1, 2, 0]


def test_frequency_and_presence_ignore_the_prompt() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    row = make_row(temperature=0.0, prompt_token_ids=[0, 0, 0], presence_penalty=2.0, frequency_penalty=2.0)
    assert Sampler(seed=0)(logits, [row]).token_ids.tolist() == [0]


# --- min_tokens -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_tokens_until_reached(ignore_eos: bool) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])  # EOS 4 first, stop token 3 second
    eos = frozenset({4})

    def sample(output: list[int]) -> int:
        row = make_row(temperature=0.0, min_tokens=2, stop_token_ids=(3,), ignore_eos=ignore_eos,
                       output_token_ids=output, eos_token_ids=eos)
        return int(Sampler(seed=0)(logits, [row]).token_ids[0])

    assert [sample([]), sample([2])] == [2, 2]
    assert sample([2, 2]) == 4


def test_min_tokens_masks_only_its_own_row() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(2, -1)
    rows = [
        make_row(temperature=0.0, min_tokens=1, eos_token_ids=frozenset({2})),
        make_row(temperature=0.0, eos_token_ids=frozenset({2})),
    ]
    assert Sampler(seed=0)(logits, rows).token_ids.tolist() == [1, 2]


def test_sampler_leaves_the_input_logits_untouched() -> None:
    logits = torch.randn(3, 8, generator=make_generator(10))
    before = logits.clone()
    rows = [
        make_row(temperature=0.0, min_tokens=2, eos_token_ids=frozenset({int(logits[0].argmax())})),
        make_row(output_token_ids=[1, 2], presence_penalty=1.0, repetition_penalty=1.3),
        make_row(top_k=2, top_p=0.5, min_p=0.1),
    ]
    Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = torch.randn(4, 12, generator=make_generator(11)) * 2  # [4, V]
    rows = [
        make_row(temperature=0.0, logprobs=3),
        make_row(temperature=0.4, repetition_penalty=1.8, prompt_token_ids=list(range(12)), logprobs=1),
        make_row(temperature=1.0, top_k=4),  # asks for nothing, still gets K columns
        make_row(temperature=0.0, min_tokens=1, eos_token_ids=frozenset({int(logits[3].argmax())}),
                 logprobs=0),
    ]
    out = Sampler(seed=0)(logits, rows)
    assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
    raw = logits.log_softmax(dim=-1)  # [4, V]
    top_logprobs, top_ids = raw.topk(3, dim=-1)
    sampled = out.token_ids.unsqueeze(1)  # [4, 1]
    assert out.logprobs.shape == out.logprob_token_ids.shape == (4, 4)
    assert torch.equal(out.logprob_token_ids, torch.cat((sampled, top_ids), dim=1))
    assert torch.allclose(out.logprobs, torch.cat((raw.gather(1, sampled), top_logprobs), dim=1))
    assert out.sampled_ranks.tolist() == (raw > raw.gather(1, sampled)).sum(dim=-1).add(1).tolist()
    assert out.sampled_ranks[0] == 1 and out.sampled_ranks[3] == 2  # greedy; greedy with its top token masked


def test_logprobs_with_k_zero_hold_only_the_sampled_token() -> None:
    logits = torch.randn(2, 6, generator=make_generator(12))
    out = Sampler(seed=0)(logits, [make_row(temperature=0.0, logprobs=0), make_row(temperature=0.0)])
    assert out.logprobs is not None and out.logprobs.shape == (2, 1)
    assert torch.allclose(out.logprobs[:, 0], logits.log_softmax(dim=-1).amax(dim=-1))
