"""Compact weights for a bf16 model on AMX (ModelConfig.compact_weights): the 4-bit projections written out into
oneDNN's blocked layout per call (engine/models/onednn_linear.py, CompactOneDnnLinear), the Q8_0 lm_head on its
int8 tiles for every call and the tied embedding looked up from them (engine/models/packed_linear.py). The
weights written out are the dense bf16 model's to the bit, so the model's tokens are the dense model's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import engine.kernels as kernels
import engine.models.onednn_linear as onednn_linear
from engine.config import ModelConfig
from engine.model_loader import load_model
from engine.models.onednn_linear import CompactOneDnnLinear, OneDnnLinear, dequantize_int4_tiles_per_call
from engine.models.packed_linear import (
    MAX_ROWS_INT4_TILES_AMX_COMPACT,
    Int8TilesDense,
    Int8TilesEmbedding,
    SmallBatchLinear,
    int8_tile_rows,
)
from engine.models.token_buckets import bucket_tokens


def _random_int4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4).half().float()
    m = (torch.rand(n, k // 32, generator=g) * -0.2).half().float()
    return q, d, m


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (64, 96)])
def test_int4_tiles_are_written_out_as_ggmls_float32_dequantization_rounded_to_bf16(cpu_kernels, shape):
    tiles = kernels.load_int4_tile_mm()
    if tiles is None:
        pytest.skip("this CPU has no AVX512_BF16")
    pack, _ = tiles
    dequantize = kernels.load_int4_tile_dequantize()
    n, k = shape
    q, d, m = _random_int4(n, k, seed=n + k)
    # GGML's Q4_1: d * q, then + m, in float32; the dense bf16 model rounds that to nearest even.
    expected = ((q.float().view(n, k // 32, 32) * d[..., None]) + m[..., None]).view(n, k).bfloat16()
    packed = pack(q, d, m)
    plain = torch.empty(n, k, dtype=torch.bfloat16)
    dequantize(packed, plain)
    assert torch.equal(plain, expected)
    with pytest.raises(RuntimeError, match="bfloat16"):
        dequantize(packed, torch.empty(n, k))
    if not onednn_linear.onednn_serves_bf16() or n % 32:
        return
    # oneDNN's blocked layout: what it reads back, and what its GEMM computes, is the reordered weight's.
    blocked = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(n, k, dtype=torch.bfloat16), 64)
    dequantize(packed, blocked)
    assert torch.equal(blocked.to_dense(), expected)
    x = torch.randn(40, k).bfloat16()
    reordered = torch.ops.mkldnn._reorder_linear_weight(expected, 64)
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], ""),
                       torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""))


def test_int8_tile_rows_are_the_q8_0_rows_rounded_to_bf16(cpu_kernels):
    tiles = kernels.load_int8_tile_mm()
    if tiles is None:
        pytest.skip("this CPU has no AMX")
    pack, _ = tiles
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (48, 96), dtype=torch.int8, generator=g)
    d = torch.rand(48, 3, generator=g) * 0.01
    expected = (q.float().view(48, 3, 32) * d[..., None]).view(48, 96).bfloat16()
    rows = torch.tensor([47, 0, 17, 17, 31])
    assert torch.equal(int8_tile_rows(pack(q, d), rows), expected[rows])


@pytest.fixture(scope="module")
def bf16_models():
    if not (onednn_linear.onednn_serves_bf16() and kernels.load_int4_tile_mm() is not None
            and kernels.load_int8_tile_mm() is not None):
        pytest.skip("compact bf16 weights need AMX and oneDNN")
    return load_model(ModelConfig(dtype="bfloat16", compact_weights=True)), load_model(ModelConfig(dtype="bfloat16"))


def test_a_compact_bf16_model_keeps_no_dense_weight_and_writes_out_the_dense_models_to_the_bit(bf16_models):
    compact, dense = bf16_models
    layers, dense_layers = compact.model.model.layers, dense.model.model.layers
    projections = [p for layer in layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert {type(p.dense) for p in projections} == {CompactOneDnnLinear}
    assert isinstance(compact.model.lm_head.dense, Int8TilesDense)
    assert isinstance(compact.model.model.embed_tokens, Int8TilesEmbedding)
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in compact.model.modules())
    assert not any(t.is_meta for t in (*compact.model.parameters(), *compact.model.buffers()))
    # Layers of one shape share one blocked buffer.
    assert layers[0].mlp.down_proj.dense.blocked_weight is layers[29].mlp.down_proj.dense.blocked_weight
    for i in (0, 17):
        for name in ("self_attn.qkv_proj", "mlp.down_proj"):
            assert torch.equal(layers[i].get_submodule(name).dense.weight, dense_layers[i].get_submodule(name).weight)
    ids = torch.tensor([[0, 7], [49151, 1234]])
    assert torch.equal(compact.model.model.embed_tokens(ids), dense.model.model.embed_tokens(ids))
    # A call past the few-row kernels runs on the written-out weight: oneDNN's GEMM over the same bf16 values.
    qkv = layers[0].self_attn.qkv_proj
    assert qkv.max_rows == MAX_ROWS_INT4_TILES_AMX_COMPACT  # the tile kernel keeps more rows than beside dense ones
    few = torch.randn(MAX_ROWS_INT4_TILES_AMX_COMPACT, qkv.in_features).bfloat16()
    weight = dense_layers[0].self_attn.qkv_proj.weight.double()
    exact = few.double() @ weight.t()
    # The tile kernel sums the 4-bit weights themselves, the dense weight is each rounded to bf16 (2^-9 of it):
    # the two differ by at most that share of sum |x| |w|, and the output's own rounding.
    bound = (few.double().abs() @ weight.abs().t()) * 2**-8 + exact.abs() * 2**-8
    assert ((qkv(few).double() - exact).abs() <= bound).all()
    x = torch.randn(qkv.max_rows + 9, qkv.in_features).bfloat16()
    reordered = OneDnnLinear(dense_layers[0].self_attn.qkv_proj.weight, None)
    assert torch.equal(qkv(x), reordered(x))
    head_x = torch.randn(40, 576).bfloat16()  # 40 sequences: past the tiles' 16-row passes
    assert torch.equal(compact.model.lm_head(head_x), compact.model.lm_head.dense(head_x))


def _no_row_splits(monkeypatch) -> None:
    """Each worker times where oneDNN's calls share out their rows, and oneDNN may sum a split call's rows in
    another order (the last bits of bf16 outputs): two workers compared token for token must not differ in that."""
    import engine.worker.cpu as cpu_worker

    monkeypatch.setattr(cpu_worker, "load_onednn_linear_split_rows", lambda: None)


def test_a_compact_bf16_model_generates_the_dense_models_greedy_tokens(bf16_models, engine_config, monkeypatch):
    from dataclasses import replace

    from engine.config import CacheConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    _no_row_splits(monkeypatch)
    compact, dense = bf16_models
    config = replace(engine_config, model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20))
    # Prompts of 200+ tokens: their prefill steps run the projections on the written-out weights.
    prompts = ["Name three rivers. " * 30, "What is two plus two?", "Write a haiku about rain. " * 25, "Hello!"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    got = [r.samples[0].token_ids for r in LLM(config=config, loaded=compact).generate(prompts, params)]
    assert compact.model.pad_tokens(600) == bucket_tokens(600, coarse=True) == 640  # the worker chose coarse buckets
    want = [r.samples[0].token_ids for r in LLM(config=config, loaded=dense).generate(prompts, params)]
    assert got == want


def test_a_shape_whose_blocked_layout_differs_keeps_its_dense_weight(bf16_models, monkeypatch, caplog):
    dense = load_model(ModelConfig(dtype="bfloat16"))  # its own: a worker has taken the fixture's dense Linears
    monkeypatch.setattr(onednn_linear, "_blocked_layout_matches", lambda *args: False)
    with caplog.at_level("WARNING", logger="engine.models.onednn_linear"):
        assert dequantize_int4_tiles_per_call(dense.model) == 0
    assert "blocked layout" in caplog.text
    assert type(dense.model.model.layers[0].mlp.down_proj.dense) is nn.Linear


def test_compact_weights_where_onednn_does_not_serve_bf16_keep_the_dense_copies(monkeypatch, caplog, cpu_kernels):
    monkeypatch.setattr(onednn_linear, "has_amx_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="engine.model_loader"):
        loaded = load_model(ModelConfig(dtype="bfloat16", compact_weights=True))
    assert "dense copies kept" in caplog.text and "loading again" not in caplog.text
    down = loaded.model.model.layers[0].mlp.down_proj
    dense = down.dense if isinstance(down, SmallBatchLinear) else down
    assert type(dense) is nn.Linear and not dense.weight.is_meta


def test_decode_steps_of_up_to_64_run_in_the_decode_layers_op_as_in_the_python_loop(bf16_models, monkeypatch):
    """Under compact weights the tile kernel takes up to 64 rows, so decode-only steps of 33-64 sequences run
    all their layers in one call of the decode-layers op: the same kernels in the same order as the loop."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.request import SamplingParams
    import engine.worker.cpu as cpu_worker

    _no_row_splits(monkeypatch)
    compact, _ = bf16_models
    config = EngineConfig(model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(kv_cache_memory_bytes=64 * 2**20),
                          scheduler=SchedulerConfig(max_num_seqs=64), worker="eager")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 30000, (int(n),), generator=g).tolist() for n in torch.randint(5, 40, (44,), generator=g)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(config=config, loaded=compact)
    assert compact.model.decode_layers is not None and compact.model.decode_layers.max_rows == 64
    in_op = [r.samples[0].token_ids for r in llm.generate(prompts, params)]
    monkeypatch.setattr(cpu_worker, "load_decode_layers", lambda: None)
    llm = LLM(config=config, loaded=compact)
    assert compact.model.decode_layers is None
    assert [r.samples[0].token_ids for r in llm.generate(prompts, params)] == in_op
