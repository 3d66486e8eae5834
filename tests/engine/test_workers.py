"""Every worker computes what the eager CPU worker computes (greedy tokens in float32; the next-token
distribution in bfloat16, where kernels round differently)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.cpu_features import has_native_bf16, is_amd_zen
from engine.llm import LLM
from engine.model_loader import load_model
from engine.request import SamplingParams
from engine.worker import resolve_worker_kind
from engine.worker.cpu import zentorch_available

PROMPTS = ["The three primary colours are", "def add(a, b):", "Once upon a time, in a land far away,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _config(worker: str, dtype: str = "float32") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(dtype=dtype),
        cache=CacheConfig(kv_cache_memory_bytes=32 * 1024 * 1024),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        worker=worker,
    )


@pytest.fixture(scope="module")
def eager_tokens(smollm_fp32):
    llm = LLM(config=_config("eager"), loaded=smollm_fp32)
    return [r.samples[0].token_ids for r in llm.generate(PROMPTS, GREEDY)]


def test_auto_picks_a_worker_this_machine_can_run():
    kind = resolve_worker_kind("auto")
    if torch.cuda.is_available():
        assert kind == "cuda"
    elif is_amd_zen() and zentorch_available():
        assert kind == "zentorch"
        assert resolve_worker_kind("auto", torch.bfloat16) == ("zentorch" if has_native_bf16() else "eager")
    else:
        assert kind == "eager"


@pytest.mark.skipif(torch.cuda.is_available() or not (is_amd_zen() and zentorch_available()),
                    reason="auto picks zentorch on AMD Zen with zentorch installed, no GPU")
def test_bf16_without_avx512_bf16_runs_on_the_eager_worker_and_zentorch_refuses_it(monkeypatch, smollm_fp32):
    # zentorch's bf16 GEMMs raise on such a CPU (a Zen 3: "needs the cpu support avx512bf16").
    import engine.worker
    from engine.errors import ConfigError
    from engine.kv_cache_spec import make_kv_cache_layout
    from engine.worker import create_worker

    monkeypatch.setattr(engine.worker, "has_native_bf16", lambda: False)
    assert resolve_worker_kind("auto", torch.bfloat16) == "eager"
    assert resolve_worker_kind("auto", torch.float32) == "zentorch"
    layout = make_kv_cache_layout(smollm_fp32.arch, 16, torch.bfloat16, 1 << 22)
    with pytest.raises(ConfigError, match="AVX512_BF16"):
        create_worker("zentorch", smollm_fp32.model, layout, torch.bfloat16)


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
def test_zentorch_worker_matches_eager(eager_tokens):
    # zentorch compiles the model's layers in place: give it its own copy of the weights.
    llm = LLM(config=_config("zentorch"), loaded=load_model(ModelConfig(dtype="float32")))
    assert llm.engine.worker.name == "zentorch"
    assert [r.samples[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == eager_tokens


@pytest.mark.skipif(not (zentorch_available() and has_native_bf16()), reason="zentorch's bf16 GEMMs need AVX512_BF16")
def test_zentorch_worker_in_bfloat16_keeps_the_eager_next_token_distribution():
    # The served default: bf16, the projections' larger batches and the lm_head on zentorch's
    # prepacked GEMMs (the lm_head is tied to the embedding, which must keep its own weights).
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    runs = {}
    for worker in ("eager", "zentorch"):
        llm = LLM(config=_config(worker, "bfloat16"), loaded=load_model(ModelConfig(dtype="bfloat16")))
        assert llm.engine.worker.name == worker
        runs[worker] = [r.samples[0].logprobs for r in llm.generate(PROMPTS, params)]
    # Logits of these sizes round to steps of 0.125 in bf16, and each worker rounds its own way: a
    # chosen token's logprob may differ by a step and the shift that step gives the normalizer (0.153
    # seen on an Intel Xeon, where both workers' decodes run on AMX; each worker's own distance from
    # float32 reaches 0.175 there, on a mean of 0.04-0.05). So one step and a half apart at most, and
    # a mean well under a step: a kernel that computed wrong would move them by whole units.
    step = 0.125
    differences = []
    for eager, zen in zip(runs["eager"], runs["zentorch"], strict=True):
        first_e, first_z = eager[0], zen[0]
        if first_e.token_id != first_z.token_id:
            # A bf16 near-tie (seen: two tokens 0.125 apart, one step of the bf16 logits, swapped):
            # each picks one of the other's top two (an exact tie may list the two either way round),
            # at the same probability.
            assert first_z.token_id in {t for t, _ in first_e.top[:2]}
            assert first_e.token_id in {t for t, _ in first_z.top[:2]}
            assert abs(first_e.logprob - first_z.logprob) < 1.5 * step
            continue
        for e, z in zip(eager, zen):  # while the greedy paths agree (bf16 near-ties may split them)
            if e.token_id != z.token_id:
                break
            differences.append(abs(e.logprob - z.logprob))
            assert differences[-1] < 1.5 * step
            assert {t for t, _ in e.top[:2]} & {t for t, _ in z.top[:2]}
    assert differences and sum(differences) / len(differences) < step / 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_worker_matches_eager(eager_tokens):
    llm = LLM(config=_config("cuda"), loaded=load_model(ModelConfig(dtype="float32")))
    assert llm.engine.worker.name == "cuda"
    assert [r.samples[0].token_ids for r in llm.generate(PROMPTS, GREEDY)] == eager_tokens


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
@pytest.mark.parametrize("shape, view", [((5, 64), None), ((64, 5), "t"), ((5, 3, 64), None)])
def test_zentorch_rms_norm_matches_torch_for_every_input_layout(shape, view):
    # zentorch's kernel is used for contiguous 2-D input only (wrong on a transposed view, NaN on 3-D).
    from engine.models.llama import RMSNorm
    from engine.worker.cpu import ZentorchRMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(shape)
    x = x.t() if view == "t" else x
    assert torch.allclose(ZentorchRMSNorm(norm)(x), norm(x), atol=1e-5)


@pytest.mark.skipif(not zentorch_available(), reason="zentorch is not installed")
@pytest.mark.parametrize("splits", [True, False])
def test_zentorch_worker_hands_the_lm_heads_larger_calls_to_the_gemm_where_the_cpu_splits_256_bit_vectors(
        monkeypatch, cpu_kernels, splits):
    # On a Zen 1 zentorch's prepacked float32 GEMM beats the Q8_0 lm_head's group kernel from about 8 rows;
    # the Q4_1 projections keep their group kernel to 32 rows on every CPU (its panels win there too).
    import engine.worker.cpu
    from engine.models.packed_linear import (
        MAX_ROWS_INT4_GROUPS,
        MAX_ROWS_INT8_GROUPS_FLOAT32,
        MAX_ROWS_INT8_GROUPS_FLOAT32_HALF_WIDTH,
        SmallBatchLinear,
    )
    from engine.worker.cpu import ZentorchLinear

    monkeypatch.setattr(engine.worker.cpu, "splits_256_bit_vectors", lambda: splits)
    llm = LLM(config=_config("zentorch"), loaded=load_model(ModelConfig(dtype="float32")))
    model = llm.engine.worker.model
    groups = [m for m in model.modules() if isinstance(m, SmallBatchLinear) and m.kind == "int4_groups"]
    assert len(groups) == 4 * 30 and all(isinstance(m.dense, ZentorchLinear) for m in groups)
    assert {m.max_rows for m in groups} == {MAX_ROWS_INT4_GROUPS}
    # The layers in one call (they need zenserve's norms, which this worker keeps)
    assert model.decode_layers is not None and model.decode_layers.max_rows <= MAX_ROWS_INT4_GROUPS
    head = model.lm_head
    assert head.kind == "int8_groups" and isinstance(head.dense, ZentorchLinear)
    cap = MAX_ROWS_INT8_GROUPS_FLOAT32_HALF_WIDTH if splits else MAX_ROWS_INT8_GROUPS_FLOAT32
    assert head.max_rows == cap
    # The calls route by rows: up to the cap on the group kernel, past it on zentorch's GEMM.
    x = torch.randn(cap + 1, head.in_features, generator=torch.Generator().manual_seed(0))
    assert torch.equal(head(x), head.dense(x))
    few = x[:cap].contiguous()
    assert torch.equal(head(few), head.int8_group_mm(few, head.packed_weight, head.group_scales))


@pytest.mark.skipif(not (zentorch_available() and has_native_bf16()), reason="zentorch's bf16 GEMMs need AVX512_BF16")
def test_zentorch_worker_keeps_the_bf16_lm_heads_q8_0_tiles_for_a_few_rows(cpu_kernels):
    # The tied Q8_0 lm_head on int8_tile_mm for a few rows (from memory, its 30 MB beat the dense 57 MB), its
    # larger calls on zentorch's prepacked GEMM: up to 16 rows on AMX's tiles, 6 on VDPBF16PS elsewhere.
    from engine.kernels import int8_tile_mm_uses_amx, load_int8_tile_mm
    from engine.models.packed_linear import MAX_ROWS_INT8_TILES, MAX_ROWS_INT8_TILES_DOT, SmallBatchLinear
    from engine.worker.cpu import ZentorchLinear

    if load_int8_tile_mm() is None:
        pytest.skip("int8_tile_mm is not built here")
    llm = LLM(config=_config("zentorch", "bfloat16"), loaded=load_model(ModelConfig(dtype="bfloat16")))
    head = llm.engine.worker.model.lm_head
    assert isinstance(head, SmallBatchLinear) and head.kind == "int8_tiles"
    assert isinstance(head.dense, ZentorchLinear)
    cap = MAX_ROWS_INT8_TILES if int8_tile_mm_uses_amx() else MAX_ROWS_INT8_TILES_DOT
    assert head.max_rows == cap
    x = torch.randn(cap + 1, head.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    assert torch.equal(head(x), head.dense(x))
    few = x[:cap].contiguous()
    tiles = head(few)
    assert torch.equal(tiles, head.int8_tile_mm(few, head.packed_weight))
    # Both are the Q8_0 weight's product within bf16 rounding (the dense weight is that weight rounded to bf16).
    dense = head.dense(few).float()
    assert (tiles.float() - dense).abs().max() <= 0.02 * dense.abs().max()
