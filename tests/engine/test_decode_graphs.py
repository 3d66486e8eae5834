"""The cuda worker's decode graphs: steps padded to a (batch, context) bucket compute what the unpadded
step computes. Off a GPU the padded forward runs eagerly (DecodeGraphs(capture=False)), which checks
the padding, the scratch block and the metadata derived from the block table; tests/engine/
test_cuda_worker.py replays the captured graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.attention import build_attention_metadata
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.llm import LLM
from engine.request import SamplingParams
from engine.worker.decode_graphs import MAX_BUCKET_POSITIONS, DecodeGraphs
from engine.worker.torch_worker import TorchWorker

CPU = torch.device("cpu")


def graphs_worker(loaded, layout) -> TorchWorker:
    """The cuda worker's set-up on the CPU: torch ops, a scratch block, graphs run eagerly."""
    worker = TorchWorker(loaded.model, layout, loaded.dtype, CPU, scratch_blocks=1)
    worker.decode_graphs = DecodeGraphs(loaded.model, worker.kv_caches_with_scratch, layout.block_size,
                                        layout.num_blocks, 0, CPU, capture=False)
    return worker


def test_buckets_round_batch_and_context_up():
    graphs = DecodeGraphs(torch.nn.Identity(), [], 16, 4, 0, CPU, capture=False)
    assert graphs.bucket_for(1, 1) == (1, 256)
    assert graphs.bucket_for(5, 300) == (8, 512)
    assert graphs.bucket_for(16, 256) == (16, 256)
    assert graphs.bucket_for(17, 257) == (24, 512)
    assert graphs.bucket_for(257, 10) is None  # past the largest batch bucket
    assert graphs.bucket_for(256, MAX_BUCKET_POSITIONS // 128) is None  # too many positions to gather


def test_prepare_builds_the_buckets_of_short_contexts_up_to_the_batch_limit():
    graphs = DecodeGraphs(torch.nn.Identity(), [], 16, 4, 0, CPU, capture=False)
    assert graphs.prepare(3, 300) == 6
    assert set(graphs.buckets) == {(b, c) for b in (1, 2, 4) for c in (256, 512)}
    assert graphs.prepare(3, 300) == 0  # nothing new
    graphs = DecodeGraphs(torch.nn.Identity(), [], 16, 4, 0, CPU, capture=False)
    assert graphs.prepare(64, 8192) == 27  # longer contexts than 1,024 wait for their first use
    assert set(graphs.buckets) == {(b, c) for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) for c in (256, 512, 1024)}
    graphs = DecodeGraphs(torch.nn.Identity(), [], 16, 4, 0, CPU, capture=False)
    assert graphs.prepare(2, 100) == 2 and set(graphs.buckets) == {(1, 256), (2, 256)}


@pytest.mark.parametrize("sliding_window", [0, 8])
def test_a_padded_decode_step_computes_the_unpadded_one(smollm_fp32, sliding_window):
    loaded = smollm_fp32
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)  # 22 blocks
    worker = graphs_worker(loaded, layout)
    graphs = worker.decode_graphs
    torch.manual_seed(0)
    # Three sequences in scattered blocks, prefilled, then one decode step each.
    sequences = [([3, 7], 20), ([1], 9), ([12, 5, 9], 40)]
    with torch.inference_mode():
        for blocks, length in sequences:
            meta, positions = build_attention_metadata([], [(blocks, 0, length)], 16, sliding_window, CPU)
            loaded.model(torch.randint(0, 1000, (length,)), positions, worker.kv_caches, meta)
        contexts = [(blocks, length + 1) for blocks, length in sequences]
        tokens = [11, 22, 33]
        meta, positions = build_attention_metadata(contexts, [], 16, sliding_window, CPU)
        expected = loaded.model(torch.tensor(tokens), positions, worker.kv_caches, meta)
        after_reference = [k.clone() for k, _ in worker.kv_caches_with_scratch]
        key = graphs.bucket_for(3, 41)
        assert key == (4, 256)
        graphs.sliding_window = sliding_window
        got = graphs.run(key, contexts, tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    scratch = slice(layout.num_blocks * 16, (layout.num_blocks + 1) * 16)
    for layer, (k, _) in enumerate(worker.kv_caches_with_scratch):
        # The real blocks hold what the unpadded step wrote; the padded row wrote slot 0 of the scratch block.
        torch.testing.assert_close(k[: scratch.start], after_reference[layer][: scratch.start], atol=1e-5, rtol=1e-5)
        assert k[scratch][0].abs().sum() > 0 and k[scratch][1:].abs().sum() == 0

def test_the_engine_through_padded_decode_steps_decodes_as_the_eager_worker(smollm_fp32):
    # Batches of 1 to 6 decodes (buckets 1, 2, 4, 8), chunked prefill, preemption: greedy tokens alike.
    def run(with_graphs: bool) -> tuple[list[list[int]], int]:
        bytes_per_block = 2 * 16 * 3 * 64 * 4 * smollm_fp32.arch.num_hidden_layers
        config = EngineConfig(
            model=ModelConfig(dtype="float32"),
            cache=CacheConfig(kv_cache_memory_bytes=14 * bytes_per_block, kv_cache_dtype="model"),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40),
            worker="eager",
        )
        llm = LLM(config=config, loaded=smollm_fp32)
        core = llm.engine
        if with_graphs:
            core.worker = graphs_worker(smollm_fp32, core.layout)
        chats = [f"Tell me {'a lot ' * (i % 4)}about {topic}." for i, topic in
                 enumerate(["rivers", "owls", "chess", "bread", "jazz", "the moon"])]
        prompts = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]),
                                        add_special_tokens=False) for c in chats]
        results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
        assert core.scheduler.num_preemptions > 0
        replays = core.worker.decode_graphs.replays if with_graphs else 0
        return [r.samples[0].token_ids for r in results], replays

    eager, _ = run(False)
    padded, replays = run(True)
    assert replays > 20  # most steps were decode-only ones served through the buckets
    assert padded == eager
