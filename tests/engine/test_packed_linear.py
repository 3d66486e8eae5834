"""Small-batch int4/int8 kernels: exact recovery of GGUF 4-bit weights, dispatch by row count,
and the embedded model's logits on the packed path against float32."""

from __future__ import annotations

import gguf
import pytest
import torch
from torch import nn

from engine.attention import build_attention_metadata
from engine.config import ModelConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import load_model
import engine.kernels as kernels
from engine.models.packed_linear import (
    MAX_ROWS_INT4_GROUPS,
    MAX_ROWS_INT4_GROUPS_COMPACT,
    MAX_ROWS_INT4_TILES,
    MAX_ROWS_INT4_TILES_AMX,
    Int4Groups,
    Int4GroupsDense,
    Int8Groups,
    Int8GroupsDense,
    Int8GroupsEmbedding,
    Int8Rows,
    SmallBatchLinear,
    dequantize_int4_groups_per_call,
    fuse_packable,
    recover_packable,
)
from engine.worker.cpu import CPUWorker


def gguf_roundtrip(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    raw = gguf.quants.quantize(weight.numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(weight.shape).copy())


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(dtype)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0])
def test_gguf_4bit_weights_are_recovered_exactly(qtype):
    torch.manual_seed(0)
    weight = gguf_roundtrip(torch.randn(96, 128) * 0.05, qtype)
    packed = recover_packable(weight, qtype.name)
    assert isinstance(packed, Int4Groups)
    assert packed.q.min() >= 0 and packed.q.max() <= 15
    groups = packed.q.float().reshape(96, 4, 32)
    recon = ((groups - 8) * packed.scale[..., None] + packed.zero[..., None]).reshape(96, 128)
    assert torch.allclose(recon, weight, rtol=0, atol=1e-6), (recon - weight).abs().max()


def test_a_weight_that_is_not_4bit_gets_no_packed_copy():
    torch.manual_seed(0)
    assert recover_packable(torch.randn(64, 128), "Q4_1") is None
    assert recover_packable(torch.randn(64, 128), "Q4_0") is None
    assert recover_packable(torch.randn(64, 128), "F16") is None
    assert recover_packable(torch.randn(64, 100), "Q8_0") is None  # K not a multiple of the group


def test_int4_kernel_matches_the_dequantized_weight_and_large_batches_stay_dense():
    torch.manual_seed(1)
    weight = gguf_roundtrip(torch.randn(192, 256) * 0.05, gguf.GGMLQuantizationType.Q4_1)
    bias = torch.randn(192) * 0.1
    layer = SmallBatchLinear(dense_linear(weight, bias), recover_packable(weight, "Q4_1"))
    small = torch.randn(layer.max_rows, 256).to(torch.bfloat16)
    expected = small.float() @ weight.t() + bias
    got = layer(small).float()
    # bf16 activations, scales and output: about 3 significant digits.
    assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2), (got - expected).abs().max()
    # The packed path really ran: dense bf16 rounds the weights themselves and differs a little.
    assert not torch.equal(got, layer.dense(small).float())
    big = torch.randn(layer.max_rows + 1, 256).to(torch.bfloat16)
    assert torch.equal(layer(big), layer.dense(big))


def test_a_float32_layer_runs_its_4bit_groups_on_zenserves_kernel(cpu_kernels):
    torch.manual_seed(1)
    weight = gguf_roundtrip(torch.randn(192, 256) * 0.05, gguf.GGMLQuantizationType.Q4_1)
    bias = torch.randn(192) * 0.1
    layer = SmallBatchLinear(dense_linear(weight, bias, torch.float32), recover_packable(weight, "Q4_1"))
    assert layer.kind == "int4_groups" and layer.max_rows == MAX_ROWS_INT4_GROUPS
    for rows in (1, 2, 3, 4, 5, 8, 9):  # every unrolled row count, and blocks of four with what is left
        x = torch.randn(rows, 256)
        expected = x.double() @ weight.double().t() + bias.double()
        got = layer(x)
        assert got.dtype == torch.float32
        # float32 sums of the checkpoint's own values: about 7 significant digits.
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (got.double() - expected).abs().max()
    big = torch.randn(layer.max_rows + 1, 256)
    assert torch.equal(layer(big), layer.dense(big))
    # The op itself past the layer's rows, and bf16 rows (summed in float32, rounded once).
    x = torch.randn(layer.max_rows + 3, 256)
    got = layer.int4_group_mm(x, layer.packed_weight, layer.group_scales, layer.group_mins)
    assert torch.allclose(got.double(), x.double() @ weight.double().t(), rtol=1e-5, atol=1e-5)
    xb = x[:3].bfloat16()
    got = layer.int4_group_mm(xb, layer.packed_weight, layer.group_scales, layer.group_mins)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), xb.double() @ weight.double().t(), rtol=8e-3, atol=1e-3)


def test_a_float32_layers_larger_calls_run_on_its_4bit_weights_written_out_per_call(cpu_kernels):
    torch.manual_seed(2)
    weights = [gguf_roundtrip(torch.randn(n, 256) * 0.05, gguf.GGMLQuantizationType.Q4_1) for n in (192, 64)]
    biases = [torch.randn(192) * 0.1, None]
    layers = nn.ModuleList(SmallBatchLinear(dense_linear(w, b, torch.float32), recover_packable(w, "Q4_1"))
                           for w, b in zip(weights, biases))
    assert dequantize_int4_groups_per_call(layers) == 2
    assert all(isinstance(layer.dense, Int4GroupsDense) for layer in layers)
    assert all(layer.max_rows == MAX_ROWS_INT4_GROUPS_COMPACT for layer in layers)
    assert not any(isinstance(m, nn.Linear) for m in layers.modules())  # the dense float32 copies are gone
    assert layers[0].dense.scratch is layers[1].dense.scratch  # one buffer that the weights take turns in
    # Turns in the same buffer, each call answering with its own weight, at and past the packed kernel's rows.
    for rows in (layers[0].max_rows + 1, 40):
        for i in (0, 1, 0, 1):
            x = torch.randn(rows, 256)
            expected = x.double() @ weights[i].double().t()
            if biases[i] is not None:
                expected += biases[i].double()
            got = layers[i](x)
            assert got.shape == (rows, weights[i].shape[0])
            assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (got.double() - expected).abs().max()
    # The weight written out is the checkpoint's, to the recovery's float32 rounding.
    assert torch.allclose(layers[0].weight, weights[0], rtol=0, atol=1e-6)
    assert dequantize_int4_groups_per_call(layers) == 0  # already done: nothing left to replace
    dequantize = kernels.load_int4_group_dequantize()
    dense = layers[1].dense
    with pytest.raises(RuntimeError, match="out must be"):
        dequantize(dense.packed_weight, dense.group_scales, dense.group_mins, torch.empty(64, 255))
    with pytest.raises(RuntimeError, match="d and mins"):
        dequantize(dense.packed_weight, dense.group_scales[:, :4], dense.group_mins, torch.empty(64, 256))


def test_off_the_cpu_the_dense_weights_serve(cpu_kernels):
    # The cuda worker moves the whole model: the packed kernels are CPU ones and have no other device's
    # kernel (meta stands in for the GPU here: it has no kernel for them either).
    weight = gguf_roundtrip(torch.randn(64, 128) * 0.05, gguf.GGMLQuantizationType.Q4_1)
    for dtype in (torch.float32, torch.bfloat16):
        layer = SmallBatchLinear(dense_linear(weight, None, dtype), recover_packable(weight, "Q4_1")).to("meta")
        assert layer(torch.empty(1, 128, dtype=dtype, device="meta")).shape == (1, 64)


def test_the_int4_pack_keeps_llama_cpps_nibble_order(cpu_kernels):
    pack, mm = kernels.load_int4_group_mm()
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack(q)
    assert packed.shape == (3, 32)
    groups = packed.view(3, 2, 16)
    assert torch.equal(groups & 0xF, q.view(3, 2, 2, 16)[:, :, 0])  # byte i: q_i low, q_{i+16} high
    assert torch.equal(groups >> 4, q.view(3, 2, 2, 16)[:, :, 1])
    with pytest.raises(RuntimeError, match="0..15"):
        pack(torch.full((3, 64), 16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="d and mins"):
        mm(torch.randn(1, 64), packed, torch.ones(3, 2), torch.ones(3, 3))


def test_int4_group_mm_from_five_rows_runs_the_weight_written_out_a_panel_at_a_time(cpu_kernels):
    """From five rows the kernel writes four weight rows at a time out in float32 and runs every row of x
    against them; 66 outputs leave two past the last panel, which the per-row kernel takes."""
    torch.manual_seed(5)
    pack, mm = kernels.load_int4_group_mm()
    dequantize = kernels.load_int4_group_dequantize()
    q = torch.randint(0, 16, (66, 96), dtype=torch.uint8)
    d, mins = torch.rand(66, 3) * 0.02, -torch.rand(66, 3) * 0.1
    packed = pack(q)
    weight = torch.empty(66, 96)
    dequantize(packed, d, mins, weight)
    x = torch.randn(33, 96)
    for rows in (4, 5, 6, 7, 8, 9, 16, 33):  # tiles of three rows and of two, and the per-row kernel below five
        got = mm(x[:rows], packed, d, mins)
        expected = x[:rows].double() @ weight.double().t()
        assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5), (rows, (got.double() - expected).abs().max())
    # Each row's sums run in one order whatever tile it falls in: a row's outputs do not depend on the
    # other rows of a call of five or more.
    assert torch.equal(mm(x[:5], packed, d, mins), mm(x[:16], packed, d, mins)[:5])
    assert torch.equal(mm(x[3:8], packed, d, mins), mm(x, packed, d, mins)[3:8])


@pytest.fixture(scope="module")
def int4_tile_kernels(cpu_kernels):
    found = kernels.load_int4_tile_mm()
    if found is None:
        pytest.skip("this CPU has no AVX512_BF16")
    return found


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0])
def test_a_bf16_layer_runs_its_4bit_weights_on_the_tile_kernel(int4_tile_kernels, qtype):
    torch.manual_seed(2)
    weight = gguf_roundtrip(torch.randn(192, 320) * 0.05, qtype)  # 12 column blocks, 10 groups
    bias = torch.randn(192) * 0.1
    layer = SmallBatchLinear(dense_linear(weight, bias), recover_packable(weight, qtype.name))
    on_amx = kernels.int4_tile_mm_uses_amx()
    assert layer.kind == "int4_tiles" and layer.max_rows == (MAX_ROWS_INT4_TILES_AMX if on_amx else MAX_ROWS_INT4_TILES)
    assert layer.packed_weight.shape == (12, 10, 320)
    for rows in range(1, layer.max_rows + 1):  # every unrolled row count, one and more row blocks
        x = torch.randn(rows, 320).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
        # The checkpoint's own weights, exact products and float32 sums, then one bf16 rounding (2^-8
        # relative) of the product and one of its sum with the bias.
        exact = x.double() @ weight.double().t()
        with_bias = exact + layer.dense.bias.double()
        assert ((got.double() - with_bias).abs() <= (exact.abs() + with_bias.abs()) * 2**-8 + 1e-5).all()
        product = layer.int4_tile_mm(x, layer.packed_weight)
        assert ((product.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    big = torch.randn(layer.max_rows + 1, 320).bfloat16()
    assert torch.equal(layer(big), layer.dense(big))
    # The op itself past the layer's rows (four row blocks), on rows that are not contiguous.
    x = torch.randn(19, 400).bfloat16()[:, 80:]  # rows 400 apart
    exact = x.double() @ weight.double().t()
    got = layer.int4_tile_mm(x, layer.packed_weight)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_the_tile_kernel_is_exact_to_bf16_and_row_for_row_the_same_at_every_row_count(int4_tile_kernels):
    # 1-2 rows on VDPBF16PS; where the CPU has AMX, 3-16 rows with two groups in flight (11 groups: an odd
    # one left), 17-32 in two halves of the rows, more in passes of 32.
    pack, mm = int4_tile_kernels
    torch.manual_seed(4)
    n, k = 48, 352
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.01 + 0.001).half().float()
    mins = (-8 * d + torch.randn(n, k // 32) * 0.002).half().float()
    weight = (q.float().view(n, k // 32, 32) * d[..., None] + mins[..., None]).view(n, k)
    packed = pack(q, d, mins)
    x = torch.randn(70, k).bfloat16()
    exact = x.double() @ weight.double().t()
    whole = mm(x, packed)
    assert ((whole.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()
    for rows in [1, 2, 3, 4, 7, 15, 16, 17, 31, 32, 33, 48, 49]:
        got = mm(x[:rows], packed)
        assert ((got.double() - exact[:rows]).abs() <= exact[:rows].abs() * 2**-8 + 1e-5).all(), rows
        if rows >= 3:  # one path for every call from 3 rows on: a row's sums do not depend on its neighbours
            assert torch.equal(got, whole[:rows]), rows


def test_the_tile_kernel_refuses_what_it_cannot_pack_or_multiply(int4_tile_kernels):
    pack, mm = int4_tile_kernels
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    d = torch.full((32, 2), 0.01).half().float()
    packed = pack(q, d, -8 * d)
    with pytest.raises(RuntimeError, match="0..15"):
        pack(torch.full((32, 64), 16, dtype=torch.uint8), d, d)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(q[:24], d[:24], d[:24])
    with pytest.raises(RuntimeError, match="float16 values"):
        pack(q, d + 1e-6, d)
    with pytest.raises(RuntimeError, match="columns"):
        mm(torch.randn(1, 96).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        mm(torch.randn(1, 64), packed)


def test_4bit_weights_whose_scales_are_not_float16_keep_torchs_int4_kernel(int4_tile_kernels):
    # Not from a GGUF: float32 scales the tile kernel's float16 ones cannot hold.
    torch.manual_seed(3)
    q = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    scale = torch.rand(64, 4) * 0.01 + 0.001
    zero = torch.randn(64, 4) * 0.01
    groups = Int4Groups(q, scale, zero)
    weight = ((q.float().view(64, 4, 32) - 8) * scale[..., None] + zero[..., None]).view(64, 128)
    layer = SmallBatchLinear(dense_linear(weight), groups)
    assert layer.kind == "int4" and layer.max_rows == 4
    x = torch.randn(2, 128).bfloat16()
    assert torch.allclose(layer(x).float(), x.float() @ weight.t(), rtol=2e-2, atol=2e-2)


def test_q8_0_weights_are_recovered_exactly_and_run_on_the_group_kernel():
    torch.manual_seed(2)
    original = torch.randn(256, 128) * 0.05
    weight = gguf_roundtrip(original, gguf.GGMLQuantizationType.Q8_0)
    packed = recover_packable(weight, "Q8_0")
    assert isinstance(packed, Int8Groups) and packed.scale.shape == (256, 4)
    assert torch.equal(packed.dequantize(), weight)  # exact: the checkpoint's own values
    layer = SmallBatchLinear(dense_linear(weight), packed)
    # A bf16 model on AMX takes the tile kernel for its Q8_0 weights (below), elsewhere the group kernel.
    assert layer.kind == ("int8_tiles" if kernels.load_int8_tile_mm() is not None else "int8_groups")
    group_mm = kernels.load_int8_group_mm()
    for rows in (1, 2, 3, 4, 5, 9, 17):  # every unrolled row count, then blocks of four with what is left
        x = torch.randn(rows, 128).to(torch.bfloat16)
        expected = x.double() @ weight.double().t()
        if rows <= layer.max_rows:  # within the bf16 rounding of the output
            assert torch.allclose(layer(x).double(), expected, rtol=8e-3, atol=1e-3), rows
        else:  # the dense bf16 GEMM, which also rounds the weights to bf16
            assert torch.allclose(layer(x).double(), expected, rtol=3e-2, atol=3e-2), rows
        got = group_mm(x, packed.q, packed.scale.float().contiguous())
        assert torch.allclose(got.double(), expected, rtol=8e-3, atol=1e-3), rows


@pytest.fixture(scope="module")
def int8_tile_kernels(cpu_kernels):
    found = kernels.load_int8_tile_mm()
    if found is None:
        pytest.skip("this CPU has neither AMX nor AVX512_BF16")
    return found


def test_the_q8_0_tile_kernel_is_exact_to_bf16_and_row_for_row_the_same_at_every_row_count(int8_tile_kernels):
    # Passes of up to 16 rows: streamed weights at 1-16 rows, unpacked once a column block beyond; 11
    # groups, so the last of a pair is left over.
    pack, mm = int8_tile_kernels
    torch.manual_seed(5)
    n, k = 48, 352
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    d = torch.rand(n, k // 32) * 0.01 + 0.001
    weight = (q.float().view(n, k // 32, 32) * d[..., None]).view(n, k)
    packed = pack(q, d)
    assert packed.shape == (3, 11, 576)
    x = torch.randn(40, k).bfloat16()
    exact = x.double() @ weight.double().t()
    whole = mm(x, packed)
    for rows in [1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 40]:
        got = mm(x[:rows], packed)
        # Exact products, float32 sums, one bf16 rounding (2^-8 relative).
        assert ((got.double() - exact[:rows]).abs() <= exact[:rows].abs() * 2**-8 + 1e-5).all(), rows
        assert torch.equal(got, whole[:rows]), rows  # a row's sums do not depend on its neighbours
    rows_apart = torch.randn(5, 400).bfloat16()[:, 48:]  # rows 400 apart
    got = mm(rows_apart, packed)
    exact = rows_apart.double() @ weight.double().t()
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_the_q8_0_tile_kernel_widens_every_int8_value_exactly(int8_tile_kernels):
    # Unit rows pick single weights, so each output is one q times d = 1: a wrong entry of the widening
    # (a table lookup where the CPU has VBMI) shows here, where a sum's 2^-8 tolerance could hide it.
    pack, mm = int8_tile_kernels
    values = torch.arange(-128, 128, dtype=torch.int16)
    q = values.roll(7).view(16, 16).repeat(1, 2).to(torch.int8)  # 16 columns x 32: every value twice
    packed = pack(q, torch.ones(16, 1))
    for rows in (1, 16, 32):  # streamed, one pass, and two passes over a block unpacked once
        got = mm(torch.eye(32)[:rows].bfloat16(), packed)
        assert torch.equal(got.float(), q[:, :rows].t().float()), rows


def test_the_q8_0_tile_kernel_refuses_what_it_cannot_pack_or_multiply(int8_tile_kernels):
    pack, mm = int8_tile_kernels
    q, d = torch.zeros(32, 64, dtype=torch.int8), torch.ones(32, 2)
    packed = pack(q, d)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        pack(q[:24], d[:24])
    with pytest.raises(RuntimeError, match="float32"):
        pack(q, d.double())
    with pytest.raises(RuntimeError, match="int8"):
        pack(q.to(torch.uint8), d)
    with pytest.raises(RuntimeError, match="columns"):
        mm(torch.randn(1, 96).bfloat16(), packed)
    with pytest.raises(RuntimeError, match="bfloat16"):
        mm(torch.randn(1, 64), packed)


def test_the_group_kernel_refuses_mismatched_shapes():
    op = kernels.load_int8_group_mm()
    q, scales = torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(1, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8, 1))
    with pytest.raises(RuntimeError, match="scales"):
        op(torch.randn(1, 64), q, torch.ones(8, 3))
    with pytest.raises(RuntimeError, match="int8"):
        op(torch.randn(1, 64), q.float(), scales)


def test_without_the_kernel_q8_0_falls_back_to_per_row_int8_within_its_own_error(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("ZENSERVE_NO_CPU_KERNELS", "1")
    torch.manual_seed(2)
    weight = gguf_roundtrip(torch.randn(256, 128) * 0.05, gguf.GGMLQuantizationType.Q8_0)
    layer = SmallBatchLinear(dense_linear(weight), recover_packable(weight, "Q8_0"))
    assert layer.kind == "int8"
    rows = Int8Rows(layer.packed_weight, layer.row_scales.float())
    recon = rows.q.float() * rows.scale[:, None]
    # Per-row rounding (half a step) and the bf16 rounding of the scale: within one step of it.
    assert ((recon - weight).abs() <= rows.scale[:, None] + 1e-6).all()
    x = torch.randn(2, 128).to(torch.bfloat16)
    assert torch.allclose(layer(x).float(), x.float() @ weight.t(), rtol=3e-2, atol=3e-2)


def test_fusing_needs_every_part_packed_the_same_way():
    torch.manual_seed(3)
    q4 = recover_packable(gguf_roundtrip(torch.randn(32, 64), gguf.GGMLQuantizationType.Q4_1), "Q4_1")
    q8 = recover_packable(torch.randn(16, 64), "Q8_0")
    assert fuse_packable([q4, None]) is None
    assert fuse_packable([q4, q8]) is None
    fused = fuse_packable([q4, q4])
    assert isinstance(fused, Int4Groups) and fused.q.shape == (64, 64)


def token_by_token_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position, computed one token per forward (a row count of 1 throughout), as decodes
    after the first: the steps whose projections run on the packed copies."""
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    blocks = list(range(-(-len(token_ids) // 16)))
    rows = []
    with torch.inference_mode():
        for pos, token in enumerate(token_ids):
            decodes, prefills = ([(blocks, pos + 1)], []) if pos else ([], [(blocks, 0, 1)])
            meta, positions = build_attention_metadata(decodes, prefills, 16, None, torch.device("cpu"))
            assert meta.packed_projections == bool(pos)
            hidden = loaded.model(torch.tensor([token]), positions, worker.kv_caches, meta)
            rows.append(loaded.model.compute_logits(hidden)[0])
    return torch.stack(rows)


def test_a_float32_model_decodes_on_the_packed_copies_as_on_its_dense_weights(smollm_fp32):
    layers = smollm_fp32.model.model.layers
    assert layers[0].self_attn.qkv_proj.kind == "int4_groups" and layers[0].mlp.down_proj.kind == "int4_groups"
    assert smollm_fp32.model.lm_head.kind == "int8_groups"  # the tied Q8_0 embedding
    dense = load_model(ModelConfig(dtype="float32", small_batch_kernels="off"))
    assert not isinstance(dense.model.lm_head, SmallBatchLinear)
    text = dense.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}], add_generation_prompt=True)
    ids = dense.tokenizer.encode(text, add_special_tokens=False)[:24]
    mine, ref = token_by_token_logits(smollm_fp32, ids), token_by_token_logits(dense, ids)
    # The same weights summed in another order: float32 rounding only.
    assert (mine - ref).abs().max() < 2e-3, (mine - ref).abs().max()
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_compact_weights_prefill_a_float32_model_on_its_4bit_weights_as_on_its_dense_ones(cpu_kernels):
    compact = load_model(ModelConfig(dtype="float32", compact_weights=True))
    dense = load_model(ModelConfig(dtype="float32", small_batch_kernels="off"))
    text = dense.tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}], add_generation_prompt=True)
    ids = dense.tokenizer.encode(text, add_special_tokens=False)[:40]

    def prefill(loaded) -> torch.Tensor:
        layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
        worker = CPUWorker(loaded.model, layout, loaded.dtype)
        meta, positions = build_attention_metadata([], [(list(range(3)), 0, len(ids))], 16, None, torch.device("cpu"))
        with torch.inference_mode():
            hidden = loaded.model(torch.tensor(ids), positions, worker.kv_caches, meta)
            return loaded.model.compute_logits(hidden)

    layers = compact.model.model.layers
    # No dense copies: 40 rows run on the weights written out per call, the lm_head's 40 on its Q8_0 groups,
    # and the tied embedding is looked up from them.
    assert {type(p.dense) for layer in layers for p in (layer.self_attn.qkv_proj, layer.mlp.down_proj)} == {Int4GroupsDense}
    assert isinstance(compact.model.lm_head.dense, Int8GroupsDense)
    assert isinstance(compact.model.model.embed_tokens, Int8GroupsEmbedding)
    assert not any(isinstance(m, (nn.Linear, nn.Embedding)) for m in compact.model.modules())
    table = dense.model.model.embed_tokens.weight
    some = torch.tensor([[0, 7], [len(table) - 1, 7]])
    assert torch.equal(compact.model.model.embed_tokens(some), table[some])  # Q8_0 rows: the checkpoint's values
    mine, ref = prefill(compact), prefill(dense)
    assert (mine - ref).abs().max() < 2e-3, (mine - ref).abs().max()
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_compact_weights_load_the_dense_copies_after_all_where_a_packed_weight_finds_no_place(monkeypatch, caplog):
    from engine.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "compact_weights", lambda self: 0)  # as if no weight could go
    with caplog.at_level("WARNING", logger="engine.model_loader"):
        loaded = load_model(ModelConfig(dtype="float32", compact_weights=True))
    assert "loading again with their dense copies" in caplog.text
    assert not any(t.is_meta for t in (*loaded.model.parameters(), *loaded.model.buffers()))
    layer = loaded.model.model.layers[0]
    assert type(layer.mlp.down_proj.dense) is nn.Linear and layer.mlp.down_proj.dense.weight.abs().sum() > 0


def test_compact_weights_serve_the_same_greedy_tokens_on_every_cpu_worker(smollm_fp32, engine_config):
    from dataclasses import replace

    from engine.llm import LLM
    from engine.request import SamplingParams
    from engine.worker import resolve_worker_kind

    compact = load_model(ModelConfig(dtype="float32", compact_weights=True))
    prompts = ["Name three rivers.", "What is two plus two?", "Write a haiku about rain.", "Hello!", "Count to five."]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    workers = ["eager"] + (["zentorch"] if resolve_worker_kind("auto", torch.float32) == "zentorch" else [])
    for worker in workers:  # five sequences: lm_head calls of five rows, past the packed copy's four
        config = replace(engine_config, worker=worker)
        got = [r.samples[0].token_ids for r in LLM(config=config, loaded=compact).generate(prompts, params)]
        want = [r.samples[0].token_ids for r in LLM(config=config, loaded=smollm_fp32).generate(prompts, params)]
        assert got == want, worker


@pytest.mark.slow
def test_embedded_model_on_small_batch_kernels_tracks_float32(smollm_fp32):
    packed = load_model(ModelConfig(dtype="bfloat16"))
    layers = packed.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, SmallBatchLinear)  # Q4_1 in the GGUF
    assert isinstance(layers[0].mlp.down_proj, SmallBatchLinear)
    if kernels.load_int4_tile_mm() is not None:  # AVX512_BF16: every 4-bit projection on the tile kernel
        assert {layer.mlp.gate_up_proj.kind for layer in layers} == {"int4_tiles"}
    assert isinstance(packed.model.lm_head, SmallBatchLinear)  # the tied Q8_0 embedding
    dense = load_model(ModelConfig(dtype="bfloat16", small_batch_kernels="off"))
    assert not isinstance(dense.model.lm_head, SmallBatchLinear)

    text = packed.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = packed.tokenizer.encode(text, add_special_tokens=False)
    from tests.engine.test_model_parity import prefill_logits

    ref = prefill_logits(smollm_fp32, ids)
    for loaded in (packed, dense):
        mine = token_by_token_logits(loaded, ids)
        # The same stated bf16 tolerance as the dense path (test_model_parity).
        diff = (mine - ref).abs()
        assert diff.mean() < 0.5 and diff.max() < 3.0, (diff.mean(), diff.max())
        assert (mine.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
