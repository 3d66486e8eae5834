"""dequantize: gguf's own dequantizers behind one call, torch-order shapes, typed errors."""

import gguf
import numpy as np
import pytest
import torch

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.dequantize import dequantize

Q = gguf.GGMLQuantizationType

# Worst-case error of a round trip, as a fraction of the 32-value block's absmax (a half step, plus
# a full step where the format clips one end, plus slack for the fp16 scales).
_BLOCK_ERROR_BOUND = {
    Q.Q8_0: 1 / 127,
    Q.Q4_0: 1 / 8 + 1e-3,
    Q.Q4_1: 1 / 15 + 1e-3,
    Q.Q5_0: 1 / 16 + 1e-3,
    Q.Q5_1: 1 / 31 + 1e-3,
}
# Element-relative error of the float formats.
_RELATIVE_ERROR_BOUND = {Q.F32: 0.0, Q.F16: 2**-11, Q.BF16: 2**-8}


@pytest.fixture
def data() -> np.ndarray:
    # Non-square on purpose: a swapped shape cannot pass. 256 = a whole block for every format.
    return np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)


@pytest.mark.parametrize("qtype", list(_BLOCK_ERROR_BOUND), ids=lambda q: q.name)
def test_block_quants_round_trip_within_bound(data, qtype):
    raw = gguf.quants.quantize(data, qtype)  # [3, bytes per row], as GGUFReader hands it over
    out = dequantize(raw, qtype, (3, 512))
    assert out.dtype == torch.float32 and out.shape == (3, 512)
    blocks_err = np.abs(out.numpy() - data).reshape(-1, 32).max(axis=1)
    blocks_amax = np.abs(data).reshape(-1, 32).max(axis=1)
    assert (blocks_err <= _BLOCK_ERROR_BOUND[qtype] * blocks_amax).all()
    np.testing.assert_array_equal(out.numpy(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", list(_RELATIVE_ERROR_BOUND), ids=lambda q: q.name)
def test_float_formats_round_trip_within_bound(data, qtype):
    raw = gguf.quants.quantize(data, qtype)
    out = dequantize(raw, qtype, (3, 512)).numpy()
    np.testing.assert_allclose(out, data, rtol=_RELATIVE_ERROR_BOUND[qtype], atol=0)
    np.testing.assert_array_equal(out, gguf.quants.dequantize(raw, qtype))


def test_f32_result_owns_its_memory():
    raw = np.arange(6, dtype=np.float32)
    raw.flags.writeable = False  # like GGUFReader's read-only memory map
    out = dequantize(raw, Q.F32, (2, 3))
    out += 1  # would raise (or write into the file) if it were a view
    assert raw[0] == 0 and out[0, 0] == 1


def test_shape_is_torch_order():
    raw = np.arange(6, dtype=np.float32)
    out = dequantize(raw, Q.F32, (2, 3))  # GGUF would call this [3, 2]
    assert out.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_q8_0_known_block():
    # Q8_0 block: fp16 scale, then 32 int8 quants; value = scale * q.
    q = np.arange(-16, 16, dtype=np.int8)
    raw = np.concatenate([np.array([0.5], np.float16).view(np.uint8), q.view(np.uint8)])
    out = dequantize(raw.reshape(1, -1), Q.Q8_0, (1, 32))
    assert out.flatten().tolist() == (0.5 * q.astype(np.float32)).tolist()


def test_q4_0_known_block():
    # Q4_0 block: fp16 scale, 16 bytes; low nibbles are values 0..15, high nibbles values 16..31;
    # value = scale * (nibble - 8).
    low, high = np.arange(16, dtype=np.uint8), np.full(16, 9, dtype=np.uint8)
    raw = np.concatenate([np.array([2.0], np.float16).view(np.uint8), low | (high << 4)])
    out = dequantize(raw.reshape(1, -1), Q.Q4_0, (1, 32)).flatten().tolist()
    assert out == [2.0 * (n - 8) for n in range(16)] + [2.0] * 16


# Byte offsets of each K-quant block's fp16 scale fields (from ggml's block_q*_K structs).
_K_QUANT_F16_OFFSETS = {
    Q.Q2_K: (80, 82),  # scales[16] qs[64] d dmin
    Q.Q3_K: (108,),  # hmask[32] qs[64] scales[12] d
    Q.Q4_K: (0, 2),  # d dmin scales[12] qs[128]
    Q.Q5_K: (0, 2),  # d dmin scales[12] qh[32] qs[128]
    Q.Q6_K: (208,),  # ql[128] qh[64] scales[16] d
}


@pytest.mark.parametrize("qtype", list(_K_QUANT_F16_OFFSETS), ids=lambda q: q.name)
def test_k_quants_match_gguf_reference(qtype):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 2
    raw = np.random.default_rng(1).integers(0, 256, (rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in _K_QUANT_F16_OFFSETS[qtype]:  # random bytes would make NaN/inf scales
        raw[:, offset : offset + 2] = np.array([0.01], np.float16).view(np.uint8)
    raw = raw.reshape(rows, blocks_per_row * type_size)
    out = dequantize(raw, qtype, (rows, blocks_per_row * block_size))
    assert out.shape == (rows, blocks_per_row * block_size)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
    np.testing.assert_array_equal(out.numpy(), gguf.quants.dequantize(raw, qtype))


def test_type_gguf_cannot_dequantize_is_unsupported_naming_tensor_and_type():
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*I32"):
        dequantize(np.zeros(4, np.int32), Q.I32, (4,), name="blk.0.attn_q.weight")


def test_unknown_type_number_is_unsupported():
    with pytest.raises(UnsupportedModelError, match=r"my\.tensor.*#999"):
        dequantize(np.zeros(4, np.uint8), 999, (4,), name="my.tensor")


def test_wrong_byte_count_is_a_load_error():
    raw = gguf.quants.quantize(np.ones((1, 32), np.float32), Q.Q8_0)
    with pytest.raises(ModelLoadError, match="t0"):
        dequantize(raw, Q.Q8_0, (1, 64), name="t0")
    with pytest.raises(ModelLoadError, match="t1"):
        dequantize(raw[:, :-1], Q.Q8_0, (1, 32), name="t1")
