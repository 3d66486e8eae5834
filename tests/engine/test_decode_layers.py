"""A decode-only step's layers in one call (engine/models/decode_layers.py): the Python loop's result bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from engine.cpu_features import has_avx512_bf16
from engine.models.decode_layers import plan_decode_layers
from engine.models.onednn_linear import onednn_serves_bf16
from engine.worker.cpu import zentorch_available as _zentorch_available

# bf16: the tile kernels, which need AVX512_BF16. float32: the group kernels, wherever the kernels build.
DTYPES = [pytest.param("bfloat16", marks=pytest.mark.skipif(not has_avx512_bf16(), reason="the bf16 tile kernels need AVX512_BF16")),
          "float32"]
needs_bf16 = pytest.mark.skipif(not has_avx512_bf16(), reason="the bf16 tile kernels need AVX512_BF16")


def _core(dtype: str, kv_cache_dtype: str):
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.core import EngineCore
    from engine.model_loader import load_model

    config = EngineConfig(model=ModelConfig(dtype=dtype),
                          cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), worker="eager")
    return EngineCore(config, load_model(config.model))


@pytest.fixture(scope="module", params=DTYPES)
def core(request, cpu_kernels):
    return _core(request.param, "auto")


@pytest.fixture(scope="module")
def bf16_core(cpu_kernels):
    return _core("bfloat16", "auto")


def _add_requests(core, prompt_lengths: list[int], max_tokens: int, seed: int) -> None:
    from engine.request import SamplingParams

    rng = random.Random(seed)
    for i, n in enumerate(prompt_lengths):
        core.add_request(f"s{seed}-{i}", [rng.randrange(100, 40000) for _ in range(n)],
                         SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@needs_bf16
def test_the_bf16_eager_worker_plans_every_layer_on_the_tile_kernels(bf16_core):
    plan = bf16_core.worker.model.decode_layers
    assert plan is not None
    assert len(plan.tensors) == 14 * 30 and len(plan.kinds) == 4 * 30 and len(plan.eps) == 2 * 30
    assert set(plan.kinds) <= {0, 1}  # int4 and int8 tiles
    assert plan.max_rows >= 16  # the int4 tile kernel's few-row limit


@needs_bf16
@pytest.mark.skipif(not _zentorch_available(), reason="zentorch is not installed")
def test_the_zentorch_worker_plans_a_bf16_models_layers_too(cpu_kernels, monkeypatch):
    # Its norms are zenserve's kernel (engine/worker/cpu.py): the plan's precondition.
    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.core import EngineCore
    from engine.model_loader import load_model

    config = EngineConfig(model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(kv_cache_memory_bytes=16 * 2**20),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512), worker="zentorch")
    core = EngineCore(config, load_model(config.model))
    plan = core.worker.model.decode_layers
    assert core.worker.name == "zentorch" and plan is not None
    assert len(plan.kinds) == 4 * 30 and set(plan.kinds) <= {0, 1}
    _assert_decode_steps_match_the_python_loop(core, monkeypatch)


def test_the_float32_eager_worker_plans_every_layer_on_the_group_kernels(cpu_kernels):
    from engine.models.packed_linear import MAX_ROWS_INT4_GROUPS
    from engine.worker.cpu import MAX_ROWS_SILU_AND_MUL, silu_kernel_every_call

    plan = _core("float32", "auto").worker.model.decode_layers
    assert plan is not None
    assert len(plan.tensors) == 14 * 30 and plan.kinds == [2] * 4 * 30  # SmolLM2's projections: all Q4_1
    # Where the activation's kernel serves every call (AVX2 alone), the plan takes as many rows as the
    # group kernels; elsewhere only as many as the activation's kernel does.
    expected = MAX_ROWS_INT4_GROUPS if silu_kernel_every_call(torch.float32) else min(MAX_ROWS_INT4_GROUPS, MAX_ROWS_SILU_AND_MUL)
    assert plan.max_rows == expected
    assert all(t.dtype == torch.float32 for t in plan.tensors[3::3][:4])  # qkv's scales and minima, o's scales


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "model", "int8", "fp8"])
def test_decode_steps_give_the_python_loops_hidden_states_and_cache_rows_bit_for_bit(core, kv_cache_dtype,
                                                                                      monkeypatch):
    from engine.cpu_features import has_avx512

    dtype = core.worker.model.model.embed_tokens.weight.dtype
    if kv_cache_dtype == "model" and dtype != torch.float32:
        pytest.skip("a bf16 model's auto cache is its own dtype: the first case")
    if kv_cache_dtype == "fp8" and (dtype != torch.bfloat16 or not has_avx512()):
        pytest.skip("the fp8 cache serves bf16 models on AVX-512 CPUs")
    core = core if kv_cache_dtype == "auto" else _core(str(dtype).removeprefix("torch."), kv_cache_dtype)
    assert core.worker.model.decode_layers is not None
    # auto: a float32 model's cache is float16 on the CPU workers.
    expected_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "model": dtype}.get(
        kv_cache_dtype, torch.float16 if dtype == torch.float32 else dtype)
    assert core.worker.kv_caches[0][0].dtype == expected_dtype
    _assert_decode_steps_match_the_python_loop(core, monkeypatch)


def test_int8_activation_groups_give_the_python_loops_result_bit_for_bit(cpu_kernels, monkeypatch):
    # A float32 model's Q4_1 copies on int4_group_mm_q8 (int8 activations, opt-in): the op's kind 4.
    from engine.models.packed_linear import SmallBatchLinear
    from engine.worker.cpu import MAX_ROWS_SILU_AND_MUL, silu_kernel_every_call

    core = _core("float32", "auto")
    model = core.worker.model
    switched = [m.quantize_activations_q8() for m in model.modules() if isinstance(m, SmallBatchLinear)]
    assert sum(switched) == 4 * 30  # every projection; the Q8_0 lm_head keeps its kind
    silu_rows = None if silu_kernel_every_call(torch.float32) else MAX_ROWS_SILU_AND_MUL
    model.decode_layers = plan_decode_layers(model.model.layers, model.model.layers[0].mlp.silu_and_mul,
                                             model.decode_layers.op, silu_rows)
    assert model.decode_layers is not None and model.decode_layers.kinds == [4] * 4 * 30
    _assert_decode_steps_match_the_python_loop(core, monkeypatch)


@needs_bf16
def test_q8_0_projections_on_the_int8_tile_kernel_give_the_python_loops_result_bit_for_bit(cpu_kernels, monkeypatch):
    # A bf16 GGUF whose projections are Q8_0: int8_tile_mm (AMX's tiles, or VDPBF16PS without AMX), the op's kind 1.
    from engine.config import ModelConfig
    from engine.model_loader import load_model
    from engine.models.int8_linear import projection_paths
    from engine.models.packed_linear import GROUP_SIZE, Int8Groups, SmallBatchLinear
    from engine.worker.cpu import MAX_ROWS_SILU_AND_MUL, silu_kernel_every_call

    core = _core("bfloat16", "auto")
    model = core.worker.model
    # The dense weights as loaded (the worker keeps them packed for its GEMM), each quantized as GGML's Q8_0.
    fresh = load_model(ModelConfig(dtype="bfloat16")).model
    loaded = {path: getattr(owner, attr).dense for path, owner, attr in projection_paths(fresh)}
    for path, owner, attr in projection_paths(model):
        dense = loaded[path]
        w = dense.weight.float()
        groups = w.view(w.shape[0], -1, GROUP_SIZE)
        scale = (groups.abs().amax(-1) / 127).clamp_min(1e-8).half().float()  # GGML's d is a float16
        q = torch.round(groups / scale[..., None]).clamp(-128, 127).to(torch.int8).view_as(w)
        setattr(owner, attr, SmallBatchLinear(dense, Int8Groups(q, scale)))
    layer = model.model.layers[0]
    assert {layer.self_attn.qkv_proj.kind, layer.mlp.down_proj.kind} == {"int8_tiles"}
    silu_rows = None if silu_kernel_every_call(torch.bfloat16) else MAX_ROWS_SILU_AND_MUL
    model.decode_layers = plan_decode_layers(model.model.layers, layer.mlp.silu_and_mul, model.decode_layers.op,
                                             silu_rows)
    assert model.decode_layers is not None and model.decode_layers.kinds == [1] * 4 * 30
    assert model.decode_layers.max_rows == min(layer.mlp.down_proj.max_rows, silu_rows or layer.mlp.down_proj.max_rows)
    _assert_decode_steps_match_the_python_loop(core, monkeypatch)


def _assert_decode_steps_match_the_python_loop(core, monkeypatch, rows: int | None = None) -> None:
    """Decode steps of `rows` decodes (default: up to six, as the plan serves) against the Python loop."""
    model = core.worker.model
    plan, dense_plan = model.decode_layers, model.decode_layers_dense
    forward = model.forward
    compared = []

    def both_paths(input_ids, positions, kv_caches, meta, inputs_embeds=None):
        if meta.decode_block is None:
            return forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        before = [(k.clone(), v.clone()) for k, v in kv_caches]
        model.decode_layers = model.decode_layers_dense = None
        expected = forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        expected_caches = [(k.clone(), v.clone()) for k, v in kv_caches]
        for (k, v), (k0, v0) in zip(kv_caches, before):
            k.copy_(k0)
            v.copy_(v0)
        model.decode_layers, model.decode_layers_dense = plan, dense_plan
        got = forward(input_ids, positions, kv_caches, meta, inputs_embeds)
        compared.append((input_ids.numel(), torch.equal(got, expected),
                         all(torch.equal(k, ek) and torch.equal(v, ev) for (k, v), (ek, ev) in zip(kv_caches, expected_caches))))
        return got

    monkeypatch.setattr(model, "forward", both_paths)
    # 17 and 40 cross block edges; six decodes a step take the group kernels past their first block of
    # four rows, where the plan serves that many (every float32 model on AVX2 alone)
    rows = rows or min(6, plan.max_rows)
    _add_requests(core, ([5, 17, 40, 3, 9, 21] * 4)[:rows], max_tokens=4, seed=1)
    while core.has_unfinished():
        core.step()
    assert compared and all(n == rows for n, _, _ in compared)
    assert all(same_hidden and same_caches for _, same_hidden, same_caches in compared), compared


@needs_bf16
@pytest.mark.skipif(onednn_serves_bf16(), reason="on AMX the dense projections are oneDNN's blocked weights, "
                    "which the one-call op does not read: steps past the packed copies run the Python loop")
def test_steps_past_the_packed_copies_run_the_bf16_dense_projections_in_one_call(cpu_kernels, monkeypatch):
    import dataclasses

    from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.core import EngineCore
    from engine.model_loader import load_model
    from engine.models.decode_layers import BF16_PAIRS_KIND, MAX_ROWS_BF16_PAIRS

    config = EngineConfig(model=ModelConfig(dtype="bfloat16"), cache=CacheConfig(kv_cache_memory_bytes=32 * 2**20),
                          scheduler=SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=1024), worker="eager")
    core = EngineCore(config, load_model(config.model))
    model = core.worker.model
    dense = model.decode_layers_dense
    assert dense is not None and dense.kinds == [BF16_PAIRS_KIND] * 4 * 30 and dense.max_rows == MAX_ROWS_BF16_PAIRS
    # It takes over where the packed copies stop, not before: there the Python loop runs them
    assert dense.min_rows == model.decode_layers.max_rows < 20
    calls = []

    def counting_op(*args):
        calls.append(args[0].shape[0])
        return dense.op(*args)

    model.decode_layers_dense = dataclasses.replace(dense, op=counting_op)
    _assert_decode_steps_match_the_python_loop(core, monkeypatch, rows=20)
    assert calls and set(calls) == {20}  # the dense plan ran each decode step


def test_more_decodes_than_the_packed_copies_serve_take_the_python_loop(core, monkeypatch):
    model = core.worker.model
    plan = model.decode_layers
    monkeypatch.setattr(model, "decode_layers_dense", None)  # a bf16 model's dense plan: the test above
    calls = []

    def counting_op(*args):
        calls.append(args[0].shape[0])
        return plan.op(*args)

    monkeypatch.setattr(model, "decode_layers", type(plan)(counting_op, plan.tensors, plan.kinds, plan.eps,
                                                           plan.num_heads, plan.scale, max_rows=2))
    _add_requests(core, [6, 7], max_tokens=3, seed=2)
    while core.has_unfinished():
        core.step()
    assert calls == [2, 2]  # the two decode steps after the prefill
    calls.clear()
    _add_requests(core, [6, 7, 8], max_tokens=3, seed=3)
    while core.has_unfinished():
        core.step()
    assert calls == []


def test_a_layer_off_the_kernels_leaves_the_model_on_the_python_loop(core):
    from engine.worker.cpu import MAX_ROWS_SILU_AND_MUL

    layers = core.worker.model.model.layers
    silu = layers[0].mlp.silu_and_mul
    plan = core.worker.model.decode_layers
    rows = None if plan.max_rows > MAX_ROWS_SILU_AND_MUL else MAX_ROWS_SILU_AND_MUL
    replanned = plan_decode_layers(layers, silu, plan.op, rows)
    assert replanned is not None and (replanned.kinds, replanned.max_rows) == (plan.kinds, plan.max_rows)
    assert plan_decode_layers(layers, lambda x: x, plan.op, rows) is None  # another activation
    dense = torch.nn.Linear(576, 576, bias=False).to(layers[0].input_layernorm.weight.dtype)
    o_proj = layers[3].self_attn.o_proj
    layers[3].self_attn.o_proj = dense
    try:
        assert plan_decode_layers(layers, silu, plan.op, rows) is None
    finally:
        layers[3].self_attn.o_proj = o_proj


def test_the_op_refuses_lists_that_do_not_describe_its_layers(core):
    plan = core.worker.model.decode_layers
    dtype = core.worker.model.model.embed_tokens.weight.dtype
    x = torch.zeros(1, 576, dtype=dtype)
    cache = torch.zeros(16, 3, 64, dtype=dtype)
    table = torch.zeros(8, 64)
    one = torch.zeros(1, dtype=torch.long)
    args = (table, table, one, one, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 9, 0, 0.125)
    with pytest.raises(RuntimeError, match="14 tensors, 4 kinds and 2 eps a layer"):
        plan.op(x, plan.tensors[:14], plan.kinds[:4], plan.eps[:2], [cache, cache], [cache, cache], *args)
    with pytest.raises(RuntimeError, match="unknown projection kind"):
        plan.op(x, plan.tensors[:14], [0, 0, 7, 0], plan.eps[:2], [cache], [cache.clone()], *args)
    mixed = [*plan.kinds[:2], 0 if plan.kinds[2] >= 2 else 2, plan.kinds[3]]  # a tile kind among group ones, or back
    with pytest.raises(RuntimeError, match="must all be tile kinds or all group kinds"):
        plan.op(x, plan.tensors[:14], mixed, plan.eps[:2], [cache], [cache.clone()], *args)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="bfloat16 for the tile kinds and float32 for the group kinds"):
        plan.op(x.to(other), plan.tensors[:14], plan.kinds[:4], plan.eps[:2], [cache], [cache.clone()], *args)


def test_a_worker_without_the_op_drops_a_plan_another_worker_left_on_the_model(core, monkeypatch):
    from engine.worker.cpu import CPUWorker

    worker = core.worker
    plan = worker.model.decode_layers
    assert plan is not None
    monkeypatch.setattr("engine.worker.cpu.load_decode_layers", lambda: None)
    try:
        CPUWorker(worker.model, worker.layout, worker.model.model.embed_tokens.weight.dtype)
        assert worker.model.decode_layers is None
    finally:
        worker.model.decode_layers = plan
