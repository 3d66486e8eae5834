"""bf16 projections on oneDNN with the weight reordered once (engine/models/onednn_linear.py), and the
eager worker's choice of it on a CPU with AMX."""

from __future__ import annotations

import pytest
import torch

import engine.worker.cpu as cpu_worker
from engine.config import ModelConfig
from engine.kv_cache_spec import make_kv_cache_layout
from engine.model_loader import load_model
from engine.models.bf16_linear import Bf16PairLinear
import engine.kernels as kernels
import engine.models.onednn_linear as onednn_linear
from engine.models.onednn_linear import (
    MAX_PLANNED_ROWS,
    MAX_ROWS_BLOCKED_TILES,
    ROW_BUCKET,
    OneDnnLinear,
    plan_row_splits,
    use_blocked_tiles,
    warm_row_counts,
)
from engine.models.token_buckets import bucket_tokens
from engine.models.packed_linear import SmallBatchLinear
from engine.worker import create_worker

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="torch has no oneDNN bf16 here")


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("rows", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("out_features, in_features", [(48, 10), (1728, 576), (576, 1536)])
def test_it_is_one_rounding_of_the_exact_product(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * out_features + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16()
    y = OneDnnLinear(w, bias)(x)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    exact = _exact(x, w, bias)
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * in_features).all()


def test_it_reads_strided_rows_and_3d_input_and_leaves_the_source_weight():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g).bfloat16()
    source = w.clone()
    layer = OneDnnLinear(w, None)
    strided = torch.randn(10, 128, generator=g).bfloat16()[:, :64]
    assert torch.equal(layer(strided), layer(strided.contiguous()))
    batch = torch.randn(2, 5, 64, generator=g).bfloat16()
    assert torch.equal(layer(batch), layer(batch.reshape(10, 64)).view(2, 5, 32))
    assert torch.equal(w, source)


@pytest.fixture(scope="module")
def split_rows(cpu_kernels):
    found = kernels.load_onednn_linear_split_rows()
    if found is None:
        pytest.skip("zenserve's kernels are not built here")
    return found


@pytest.mark.parametrize("rows", [5, 40, 300, 700])
@pytest.mark.parametrize("with_bias", [True, False])
def test_rows_shared_out_among_threads_are_one_rounding_of_the_exact_product(split_rows, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(576, 1536, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 1536, generator=g).bfloat16()
    bias = torch.randn(576, generator=g).bfloat16() if with_bias else None
    layer = OneDnnLinear(w, bias)
    y = split_rows(x, layer.blocked_weight, layer.bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 576)
    exact = _exact(x, w, bias)
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * 1536).all()


@pytest.fixture(scope="module")
def blocked_tiles(cpu_kernels):
    found = kernels.load_blocked_tile_linear()
    if found is None:
        pytest.skip("zenserve's kernels are not built here, or the CPU has no AMX")
    return found


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 45, 256, 300, 513])
@pytest.mark.parametrize("out_features, in_features, with_bias", [(32, 32, True), (960, 576, False), (576, 1536, True)])
def test_the_tile_gemm_over_the_blocked_weight_is_one_rounding_of_the_exact_product(
        blocked_tiles, rows, out_features, in_features, with_bias):
    g = torch.Generator().manual_seed(rows + out_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    # Rows 2 x in_features apart: the kernel reads x's rows in place.
    x = torch.randn(rows, 2 * in_features, generator=g).bfloat16()[:, in_features:]
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    y = blocked_tiles(x, OneDnnLinear(w, bias).blocked_weight, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    exact = _exact(x, w, bias)
    assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * in_features).all()


def test_calls_up_to_the_tile_rows_take_the_tile_gemm_and_larger_ones_onednn_where_it_sums_as_the_tiles(blocked_tiles):
    g = torch.Generator().manual_seed(5)
    layers = [OneDnnLinear((torch.randn(64, 96, generator=g) * 0.1).bfloat16(), None) for _ in range(2)]
    odd = OneDnnLinear(torch.randn(48, 10, generator=g).bfloat16(), None)  # 48 x 10: not whole tiles
    calls: list[int] = []

    def recording(x, w, bias):
        calls.append(x.shape[0])
        return blocked_tiles(x, w, bias)

    assert use_blocked_tiles([*layers, odd], recording, max_rows=40) == 2
    assert calls == [33]  # one check for the 64 x 96 shape, none for the shape the kernel cannot take
    calls.clear()
    assert [layer.tile_rows for layer in layers] == [40, 40] and odd.tile_rows == 0
    # Past the tile rows oneDNN serves the row counts found to agree with the tiles (warm_row_counts); the
    # tiles serve the others, so that no row's result depends on its call's row count.
    layers[1].onednn_rows = frozenset({200})
    for rows in (1, 40, 41, 200):
        x = torch.randn(rows, 96, generator=g).bfloat16()
        y = layers[1](x)
        exact = _exact(x, layers[1].dense_weight(), None)
        assert ((y.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5 * 96).all()
    assert calls == [1, 40, 41]
    assert odd(torch.randn(3, 10, generator=g).bfloat16()).shape == (3, 48)


def test_a_tile_gemm_that_misreads_the_blocked_layout_is_not_used(blocked_tiles, caplog):
    g = torch.Generator().manual_seed(6)
    layer = OneDnnLinear(torch.randn(64, 96, generator=g).bfloat16(), None)

    def swapped_panels(x, w, bias):  # as if the layout's two 16-column halves were the other way round
        y = blocked_tiles(x, w, bias)
        return y.view(y.shape[0], -1, 2, 16).flip(2).reshape(y.shape)

    with caplog.at_level("WARNING", logger="engine.models.onednn_linear"):
        assert use_blocked_tiles([layer], swapped_panels) == 0
    assert layer.tile_rows == 0 and "tile GEMM" in caplog.text


def test_the_plan_shares_out_rows_only_where_that_was_clearly_faster(split_rows):
    g = torch.Generator().manual_seed(1)
    down = [OneDnnLinear(torch.randn(64, 96, generator=g).bfloat16(), None) for _ in range(3)]
    up = OneDnnLinear(torch.randn(96, 64, generator=g).bfloat16(), None)
    head = OneDnnLinear(torch.randn(16384, 576, generator=g).bfloat16(), None)  # 18 MB: never split
    measured: list[tuple[int, int]] = []

    def recording_split(x, w, bias):
        measured.append((x.shape[0], x.shape[1]))
        return split_rows(x, w, bias)

    def time_both(own, shared):  # the shared-out call is "faster" for 96-wide inputs at 256 and 768 rows
        shared()
        rows, width = measured[-1]
        return 1.0, (0.5 if width == 96 and rows in (256, 768) else 0.9)

    plan = plan_row_splits([*down, up, head], recording_split, time_both)
    assert plan == {(64, 96): frozenset({256, 768}), (96, 64): frozenset()}
    assert {rows for rows, _ in measured} == set(range(ROW_BUCKET, MAX_PLANNED_ROWS + 1, ROW_BUCKET))
    assert all(layer.split_buckets == {256, 768} for layer in down) and not up.split_buckets
    assert not head.split_buckets and 576 not in {width for _, width in measured}
    # A call whose row count rounds to a planned bucket shares out its rows; others stay on oneDNN's.
    measured.clear()
    x = torch.randn(300, 96, generator=g).bfloat16()  # 300 rows: the 256 bucket
    y = down[0](x)
    assert measured == [(300, 96)]
    reference = torch.ops.mkldnn._linear_pointwise(x, down[0].blocked_weight, None, "none", [], "")
    assert ((y.float() - reference.float()).abs() <= reference.float().abs() * 2**-7 + 1e-3).all()
    down[0](torch.randn(500, 96, generator=g).bfloat16())  # the 512 bucket
    assert measured == [(300, 96)]


def test_warming_runs_one_linear_of_each_shape_at_each_row_count(monkeypatch):
    g = torch.Generator().manual_seed(2)
    linears = [OneDnnLinear(torch.randn(*shape, generator=g).bfloat16(), None)
               for shape in [(64, 96), (64, 96), (96, 64), (64, 96)]]
    calls: list[tuple[int, tuple[int, int]]] = []
    monkeypatch.setattr(OneDnnLinear, "forward", lambda self, x: calls.append((id(self), tuple(x.shape))))
    assert warm_row_counts(linears, [80, 96]) == 4
    assert calls == [(id(linears[0]), (80, 96)), (id(linears[2]), (80, 64)),
                     (id(linears[0]), (96, 96)), (id(linears[2]), (96, 64))]


@pytest.mark.parametrize("amx", [True, False])
def test_the_eager_worker_puts_bf16_projections_on_onednn_where_the_cpu_has_amx(monkeypatch, cpu_kernels, amx):
    monkeypatch.setattr(onednn_linear, "has_amx_bf16", lambda: amx)
    loaded = load_model(ModelConfig(dtype="bfloat16"))
    attn = loaded.model.model.layers[0].self_attn
    head = loaded.model.lm_head
    dense_qkv = attn.qkv_proj.dense
    x = torch.randn(attn.qkv_proj.max_rows + 1, dense_qkv.in_features).bfloat16()  # past the int4 copy
    expected = torch.nn.functional.linear(x, dense_qkv.weight)  # torch's own bf16 Linear
    embedding = loaded.model.model.embed_tokens.weight.clone()
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 4 * 1024 * 1024)
    create_worker("eager", loaded.model, layout, loaded.dtype)
    if not amx:
        assert loaded.model.pad_tokens is None  # rows run as they come: no per-row-count kernels to spare
        assert not isinstance(attn.qkv_proj.dense, OneDnnLinear)
        assert not isinstance(getattr(head, "dense", head), OneDnnLinear)
        if cpu_worker.load_bf16_linear() is not None:
            assert isinstance(attn.qkv_proj.dense, Bf16PairLinear)
        return
    assert isinstance(attn.qkv_proj, SmallBatchLinear) and isinstance(attn.qkv_proj.dense, OneDnnLinear)
    # Steps past the tile GEMM's rows run at the row counts built at start; shorter ones as they come.
    tile_rows = MAX_ROWS_BLOCKED_TILES if kernels.load_blocked_tile_linear() is not None else 0
    assert attn.qkv_proj.dense.tile_rows == tile_rows and head.dense.tile_rows == 0
    assert [loaded.model.pad_tokens(t) for t in (300, 600)] == [bucket_tokens(300, unpadded=tile_rows), 608]
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj.dense, OneDnnLinear)
    # The worker planned where the projections share out their rows (what it found depends on the machine).
    assert loaded.model.model.layers[0].mlp.down_proj.dense.split_rows is not None
    # The lm_head keeps its few-row copy; its larger calls go to oneDNN, and the tied embedding stays.
    assert isinstance(head, SmallBatchLinear) and isinstance(head.dense, OneDnnLinear)
    assert torch.equal(loaded.model.model.embed_tokens.weight, embedding)
    # The call past the int4 copy's rows takes the oneDNN path, within a bf16 rounding of torch's Linear.
    y = attn.qkv_proj(x)
    assert ((y.float() - expected.float()).abs() <= expected.float().abs() * 2**-7 + 1e-3).all()
    logits = head(torch.randn(6, head.in_features).bfloat16())
    assert logits.shape == (6, head.out_features) and torch.isfinite(logits.float()).all()


def test_warm_up_gives_onednn_only_the_row_counts_where_it_sums_as_the_tile_gemm(blocked_tiles):
    from engine.models.onednn_linear import warm_row_counts

    g = torch.Generator().manual_seed(7)
    layers = [OneDnnLinear((torch.randn(576, 576, generator=g) * 0.05).bfloat16(), None) for _ in range(2)]
    use_blocked_tiles(layers, blocked_tiles, max_rows=512)
    counts = [528, 640, 1024, 1536]
    assert warm_row_counts(layers, counts) == len(counts)  # one call a count for the shape
    agreed = layers[0].onednn_rows
    assert layers[1].onednn_rows == agreed and agreed <= set(counts)
    x = torch.randn(max(counts), 576, generator=g).bfloat16()
    one_row = blocked_tiles(x[:1], layers[1].blocked_weight, None)
    for rows in counts:  # whichever serves a count, the first row comes out as it does alone
        assert torch.equal(layers[1](x[:rows])[:1], one_row), rows
