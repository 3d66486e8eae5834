"""The torch implementation shared by the CPU and CUDA workers."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.attention import (
    PREFILL_KERNEL_MAX_CONTEXT,
    Bmm,
    DecodeBlockKernel,
    DecodeKernel,
    KvWriteKernel,
    PrefillKernel,
    PrefillSdpa,
    RotaryKernel,
    build_attention_metadata,
    torch_prefill_sdpa,
)
from engine.kv_cache_spec import KVCacheLayout
from engine.kv_quant import as_bytes
from engine.multimodal.worker_inputs import build_inputs_embeds
from engine.sampling import Sampler, SamplingRow
from engine.worker.base import StepBatch, TokenLogprobs, Worker, WorkerOutput
from engine.worker.decode_graphs import DecodeGraphs

log = logging.getLogger(__name__)


class TorchWorker(Worker):
    name = "torch"
    prefill_sdpa: PrefillSdpa = staticmethod(torch_prefill_sdpa)  # attention kernel for prefill chunks
    decode_bmm: Bmm = staticmethod(torch.bmm)  # the batched matmuls of 16-bit decode attention
    decode_kernel: DecodeKernel | None = None  # decode attention read in place; None: gather, then torch ops
    decode_block: DecodeBlockKernel | None = None  # a decode-only step's attention blocks, one call a layer
    prefill_kernel: PrefillKernel | None = None  # prefill chunks' attention read in place; None: prefill_sdpa
    prefill_kernel_max_context: int | None = PREFILL_KERNEL_MAX_CONTEXT  # longer contexts: prefill_sdpa; None: all
    rope_kernel: RotaryKernel | None = None  # q and k rotated in place outside decode blocks; None: torch ops
    kv_write_kernel: KvWriteKernel | None = None  # the cache write outside decode blocks; None: index_copy_
    decode_graphs: DecodeGraphs | None = None  # decode-only steps replayed per bucket (the cuda worker's)
    # Every row on the paths a prompt takes, whatever the batch (EngineConfig.batch_invariant): decodes run as
    # one-token prefill chunks, on the dense weights, so a row's result does not depend on its step's rows.
    batch_invariant: bool = False

    def __init__(self, model: nn.Module, layout: KVCacheLayout, dtype: torch.dtype, device: torch.device,
                 scratch_blocks: int = 0):
        """`scratch_blocks`: blocks past the layout's, which no sequence owns: rows padded to a fixed
        batch (CUDA graphs) write there. `kv_caches` are views of the layout's blocks alone."""
        self.model = model
        self.layout = layout
        self.dtype = dtype
        self.device = device
        spec = layout.groups[0].spec
        self.sliding_window = getattr(spec, "sliding_window", None) or None
        num_slots = layout.num_blocks * layout.block_size
        # The cache's own dtype: the model's, float16 or float8 rows, or int8 rows with their scales (engine/kv_quant.py).
        shape = ((layout.num_blocks + scratch_blocks) * layout.block_size, spec.num_kv_heads, spec.cache_row_size)
        self.kv_caches_with_scratch = [
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(layout.num_layers)
        ]
        self.kv_caches = [(k[:num_slots], v[:num_slots]) for k, v in self.kv_caches_with_scratch]
        self.sampler = Sampler(device=device)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches_with_scratch)

    def prepare_decode_steps(self, max_batch: int, max_context: int) -> int:
        if self.decode_graphs is None:
            return 0
        with torch.inference_mode():
            return self.decode_graphs.prepare(max_batch, max_context)

    def _zero_blocks(self, block_ids: tuple[int, ...]) -> None:
        if not block_ids:
            return
        bs = self.layout.block_size
        ids = torch.tensor(block_ids, device=self.device)
        slots = (ids[:, None] * bs + torch.arange(bs, device=self.device)).flatten()
        for k, v in self.kv_caches:
            as_bytes(k).index_fill_(0, slots, 0)  # float8's zero is the zero byte
            as_bytes(v).index_fill_(0, slots, 0)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> WorkerOutput:
        out = batch.scheduler_output
        self._zero_blocks(out.block_ids_to_zero)
        seqs = out.sequences
        # Decodes first, then prefill chunks: attention batches the decodes.
        is_decode = [seq.is_decode and not self.batch_invariant for seq in seqs]
        order = sorted(range(len(seqs)), key=lambda i: not is_decode[i])
        decodes = [i for i in order if is_decode[i]]
        prefills = [i for i in order if not is_decode[i]]
        hidden = self._forward(seqs, decodes, prefills)  # [T, hidden], rows in `order`

        # The last row of each sequence that samples.
        last_row: dict[int, int] = {}
        row = 0
        for i in order:
            row += seqs[i].num_tokens
            last_row[i] = row - 1
        return self._sample(batch, hidden, last_row)

    def _forward(self, seqs, decodes: list[int], prefills: list[int]) -> torch.Tensor:
        """The step's hidden states [T, hidden]: the decodes' rows, then the prefill chunks'."""
        contexts = [(list(seqs[i].block_ids), seqs[i].context_len) for i in decodes]
        graphs = self.decode_graphs
        if graphs is not None and not prefills and not any(seqs[i].mm_items for i in decodes):
            key = graphs.bucket_for(len(decodes), max(c for _, c in contexts))
            if key is not None:
                try:
                    return graphs.run(key, contexts, [seqs[i].token_ids[0] for i in decodes])
                except RuntimeError:
                    # A model whose forward cannot be captured: said once, and every step runs eagerly.
                    log.exception("capturing a decode step's graph failed: decode steps run eagerly")
                    self.decode_graphs = None
        order = decodes + prefills
        meta, positions = build_attention_metadata(
            contexts,
            [(list(seqs[i].block_ids), seqs[i].start_position, seqs[i].num_tokens) for i in prefills],
            self.layout.block_size,
            self.sliding_window,
            self.device,
            self.prefill_sdpa,
            self.decode_bmm,
            self.decode_kernel,
            self.decode_block,
            self.prefill_kernel,
            self.prefill_kernel_max_context,
            self.rope_kernel,
            self.kv_write_kernel,
            packed_weights=not self.batch_invariant,
        )
        token_ids = [t for i in order for t in seqs[i].token_ids]
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        inputs_embeds = build_inputs_embeds(self.model, [seqs[i] for i in order], input_ids)  # images, or None
        if inputs_embeds is None:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, inputs_embeds=inputs_embeds)
        return hidden

    def _sample(self, batch: StepBatch, hidden: torch.Tensor, last_row: dict[int, int]) -> WorkerOutput:
        seqs = batch.scheduler_output.sequences
        sample_idx = [i for i in range(len(seqs)) if batch.sampling_rows[i] is not None]
        sampled: list[int | None] = [None] * len(seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if sample_idx:
            rows_t = torch.tensor([last_row[i] for i in sample_idx], device=self.device)
            logits = self.model.compute_logits(hidden[rows_t], float32=False)  # [S, V]; the sampler widens
            rows: list[SamplingRow] = [batch.sampling_rows[i] for i in sample_idx]  # type: ignore[misc]
            result = self.sampler(logits, rows)
            token_list = result.token_ids.tolist()
            for j, i in enumerate(sample_idx):
                sampled[i] = token_list[j]
            if result.logprobs is not None:
                lp = result.logprobs.tolist()
                ids = result.logprob_token_ids.tolist()
                ranks = result.sampled_ranks.tolist()
                for j, i in enumerate(sample_idx):
                    k = rows[j].params.logprobs
                    if k is None:
                        continue
                    logprobs[i] = TokenLogprobs(
                        ids[j][0], lp[j][0], int(ranks[j]), tuple(zip(ids[j][1 : 1 + k], lp[j][1 : 1 + k]))
                    )
        return WorkerOutput(tuple(sampled), tuple(logprobs))

