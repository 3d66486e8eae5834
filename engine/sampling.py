"""The engine's one sampler: a batch of logits in, one token per row out (vLLM v1 semantics).

Order of operations per step (one call for the whole batch):

| step | rows            | what                                                         |
|------|-----------------|--------------------------------------------------------------|
| 1    | rows asking     | logprobs = log_softmax(raw logits), gathered at the end      |
| 2    | grammar rows    | tokens the structured-output grammar does not allow -> -inf  |
| 2b   | min_tokens rows | EOS and stop_token_ids -> -inf until min_tokens is reached   |
| 3    | logit_bias rows | + each listed token's bias                                   |
| 4    | penalty rows    | repetition (prompt+output), frequency and presence (output)  |
| 5    | greedy rows     | argmax                                                       |
| 6    | random rows     | / temperature -> min_p -> top_k -> top_p -> exponential race |

Every filter is row-wise and an exact identity for a row that disables it, so a row's token
never depends on which other rows share its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.request import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import GrammarMatcher

# NOTE: vLLM's _SAMPLING_EPS: a temperature this small is greedy; dividing by it could overflow.
_MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch: one sequence about to get a token."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (penalties, min_tokens)
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None  # the request's own, when params.seed is set
    grammar: GrammarMatcher | None = None  # its structured-output constraint: the tokens it allows next


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # [B, 1 + K] float32: the sampled token's logprob, then the top K (K = max asked in the batch);
    # every row gets K, callers slice. None when no row asked.
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None  # [B, 1 + K] int64, ids matching `logprobs`
    sampled_ranks: torch.Tensor | None  # [B] int64 rank of the sampled token, 1 = most likely


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator: same seed, same tokens, whatever else is in the batch."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _is_greedy(params: SamplingParams) -> bool:
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing to apply to the logits first: no logprobs, bias, penalties or min_tokens mask (the
    adjustments Sampler.__call__ makes; one added there must be excluded here too)."""
    params = row.params
    return (_is_greedy(params) and params.logprobs is None and not params.logit_bias and not params.has_penalties
            and len(row.output_token_ids) >= params.min_tokens and row.grammar is None)


class Sampler:
    """Picks the next token of every row in one call. Owns the generator of unseeded rows."""

    def __init__(self, seed: int | None = None, device: torch.device | str = "cpu",
                 row_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`row_argmax`: a faster argmax over the rows of [B, V] float32 or bfloat16 logits ([B] int64,
        the same result as torch.argmax), such as the CPU kernel; None keeps torch's."""
        self._row_argmax = row_argmax
        if seed is None:
            self._generator = torch.Generator(device=device)
            self._generator.seed()  # nondeterministic
        else:
            self._generator = make_generator(seed, device)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits: [B, V] of any float dtype, one row per entry of `rows`; never modified."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} sampling rows were given")
        if all(_is_plain_greedy(r) for r in rows):
            # The argmax of the logits as they come: a bf16 model's widen exactly to float32, so the tokens
            # are those of their float32 copy, which a step of 16 rows of SmolLM2 (3 MB) need not write.
            return SamplerOutput(self._argmax(logits), None, None, None)
        device = logits.device
        logits = logits.to(torch.float32)  # [B, V]; may alias the input, so only out-of-place below

        num_logprobs = max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)
        raw_logprobs = logits.log_softmax(dim=-1) if num_logprobs is not None else None  # [B, V]

        logits = _apply_grammars(logits, rows)
        logits = _mask_stop_tokens_before_min_tokens(logits, rows)
        logits = _apply_logit_bias(logits, rows)
        logits = _apply_row_penalties(logits, rows)

        # [B] greedy for every row; random rows overwritten below
        token_ids = self._argmax(logits)
        random_rows = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if random_rows:
            index = torch.tensor(random_rows, device=device)
            token_ids[index] = self._sample(logits[index], [rows[i] for i in random_rows])

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        return _gather_logprobs(raw_logprobs, token_ids, num_logprobs)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] -> [B] int64, torch.argmax's answer."""
        if self._row_argmax is None or logits.dtype not in (torch.float32, torch.bfloat16):
            return logits.argmax(dim=-1)
        return self._row_argmax(logits.contiguous())

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """logits: [R, V] penalized logits of random rows -> [R] sampled token ids."""
        device = logits.device
        params = [r.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device)  # [R]
        logits = logits / temperature.unsqueeze(1)  # [R, V]
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=device))
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            vocab_size = logits.shape[1]
            # a top_k past the vocabulary keeps every token (and a client's 2**63 must not overflow int64)
            top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params], device=device)
            if any(p.top_p < 1.0 for p in params):
                top_p = torch.tensor([p.top_p for p in params], device=device)
                logits = apply_top_k_top_p(logits, top_k, top_p)
            else:  # NOTE: top_k alone needs no sort, and its threshold is the same exact value
                logits = apply_top_k(logits, top_k)
        probs = logits.softmax(dim=-1)  # [R, V]
        return (probs / self._exponentials(probs, rows)).argmax(dim=-1)  # [R]

    def _exponentials(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """q ~ Exponential(1), [R, V]: argmax(probs / q) is a draw from probs (exponential race)."""
        vocab_size = probs.shape[1]
        q = torch.empty_like(probs)  # [R, V]
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            q[unseeded] = _draw_exponential((len(unseeded), vocab_size), self._generator, probs.device)
        for i, row in enumerate(rows):  # NOTE: only seeded rows loop; each advances its own generator
            if row.generator is not None:
                q[i] = _draw_exponential((vocab_size,), row.generator, probs.device)
        # NOTE: a q of exactly 0 would turn a filtered token's 0/0 into NaN, which argmax picks.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)


def _draw_exponential(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    # Drawn where the generator lives (a CPU generator cannot fill a CUDA tensor), then moved.
    return torch.empty(shape, device=generator.device).exponential_(generator=generator).to(device)


def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The constrained rows' disallowed tokens at -inf; unconstrained batches pay nothing."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return logits
    from engine.structured_output import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(len(constrained), logits.shape[1])
    for j, i in enumerate(constrained):
        rows[i].grammar.fill_bitmask(bitmask, j)
    index = torch.tensor(constrained, device=logits.device)
    logits = logits.clone() if logits.dtype == torch.float32 else logits
    logits[index] = apply_bitmask(logits[index], bitmask.to(logits.device))
    return logits


def _mask_stop_tokens_before_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: [B, V]. Rows short of min_tokens get EOS and stop_token_ids -> -inf, even with ignore_eos."""
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_tokens: list[int] = []
    for row_id, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        for token_id in row.eos_token_ids.union(row.params.stop_token_ids):
            if 0 <= token_id < vocab_size:  # an id outside the vocab can never be sampled anyway
                mask_rows.append(row_id)
                mask_tokens.append(token_id)
    if not mask_rows:
        return logits
    device = logits.device
    index = (torch.tensor(mask_rows, device=device), torch.tensor(mask_tokens, device=device))
    return logits.index_put(index, torch.tensor(float("-inf"), device=device))


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: [B, V]. Adds each row's logit_bias to its listed tokens; other rows stay bit-identical."""
    entries = [(row_id, token_id, bias) for row_id, row in enumerate(rows) for token_id, bias in row.params.logit_bias]
    if not entries:
        return logits
    device = logits.device
    row_ids, token_ids, biases = zip(*entries)
    index = (torch.tensor(row_ids, device=device), torch.tensor(token_ids, device=device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def _apply_row_penalties(logits: torch.Tensor, all_rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits: [B, V]. Penalizes only the rows that ask; the others stay bit-identical."""
    row_ids = [i for i, r in enumerate(all_rows) if r.params.has_penalties]
    if not row_ids:
        return logits
    device = logits.device
    vocab_size = logits.shape[1]
    rows = [all_rows[i] for i in row_ids]
    params = [r.params for r in rows]
    index = torch.tensor(row_ids, device=device)
    # Repetition needs the prompt too; skip building that (possibly long) tensor if no row uses it.
    prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
    penalized = apply_penalties(
        logits[index],
        _pad(prompts, vocab_size, device),
        _pad([r.output_token_ids for r in rows], vocab_size, device),
        presence_penalties=torch.tensor([p.presence_penalty for p in params], device=device),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params], device=device),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params], device=device),
    )
    return logits.index_copy(0, index, penalized)


def _pad(token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """Ragged token lists -> [N, L] int64 padded with `pad_id` (the vocab size: an id never seen)."""
    max_len = max(len(ids) for ids in token_ids)
    padded = [list(ids) + [pad_id] * (max_len - len(ids)) for ids in token_ids]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(token_ids), max_len)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token_ids: [N, L] padded with vocab_size -> [N, V] int64 count of each id."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))  # [N, V + 1]; last column = padding
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, out of place. logits: [N, V] float32; token ids: [N, L] padded with V;
    penalties: [N]. Repetition counts prompt and output (positive logits divided, others
    multiplied); frequency (x count) and presence (x seen) count the output only (OpenAI)."""
    vocab_size = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size)  # [N, V]
    output_seen = output_counts > 0  # [N, V]
    seen = output_seen | (_token_counts(prompt_token_ids, vocab_size) > 0)  # [N, V]
    repetition = torch.where(seen, repetition_penalties.unsqueeze(1), 1.0)  # [N, V]
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - frequency_penalties.unsqueeze(1) * output_counts
    return logits - presence_penalties.unsqueeze(1) * output_seen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V], min_p: [N] -> tokens with prob < min_p * max prob set to -inf."""
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits: [N, V]; top_k: [N] int64 (>= V = off) -> every token below the k-th largest set to
    -inf (ties with it stay). The same mask as apply_top_k_top_p with top_p = 1, via topk, not sort."""
    vocab_size = logits.shape[1]
    keep_all = top_k >= vocab_size  # [N]
    max_k = int(top_k.masked_fill(keep_all, 1).max())
    top_values = logits.topk(max_k, dim=-1).values  # [N, max_k] descending
    kth_largest = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))  # [N, 1]
    kth_largest = kth_largest.masked_fill(keep_all.unsqueeze(1), float("-inf"))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V]; top_k: [N] int64 (V = off); top_p: [N] (1.0 = off). One sort for both.

    top_k keeps every token tied with the k-th largest; top_p then keeps the smallest set of the
    most likely tokens (renormalized after top_k) whose mass reaches top_p, never fewer than one.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [N, V] ascending
    kth_index = (vocab_size - top_k).clamp(0, vocab_size - 1)  # [N]
    kth_largest = sorted_logits.gather(1, kth_index.unsqueeze(1))  # [N, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    # Ascending cumulative mass <= 1 - p: the token and everything below it are outside the nucleus.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)  # [N, V]
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def _gather_logprobs(raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> SamplerOutput:
    """raw_logprobs: [B, V], token_ids: [B] -> the sampled token's logprob and rank, then the top K."""
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)  # [B, K]
    sampled_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    ranks = (raw_logprobs >= sampled_logprobs).sum(dim=-1)  # [B]; ties rank behind, as vLLM
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=torch.cat((sampled_logprobs, top_logprobs), dim=1),  # [B, 1 + K]
        logprob_token_ids=torch.cat((token_ids.unsqueeze(1), top_ids), dim=1),  # [B, 1 + K]
        sampled_ranks=ranks,
    )
