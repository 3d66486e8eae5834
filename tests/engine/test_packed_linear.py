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
from engine.models.packed_linear import (
    Int4Groups,
    Int8Rows,
    SmallBatchLinear,
    fuse_packable,
    recover_packable,
)
from engine.worker.cpu import CPUWorker


def gguf_roundtrip(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    raw = gguf.quants.quantize(weight.numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(weight.shape).copy())


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(torch.bfloat16)


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


def test_int8_rows_from_q8_0_stay_within_its_own_quantization_error():
    torch.manual_seed(2)
    original = torch.randn(256, 128) * 0.05
    weight = gguf_roundtrip(original, gguf.GGMLQuantizationType.Q8_0)
    packed = recover_packable(weight, "Q8_0")
    assert isinstance(packed, Int8Rows)
    recon = packed.q.float() * packed.scale[:, None]
    # Per-row rounding: at most half a step of the row's scale.
    assert ((recon - weight).abs() <= packed.scale[:, None] / 2 + 1e-7).all()
    layer = SmallBatchLinear(dense_linear(weight), packed)
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
    """Logits at every position, computed one token per forward (a row count of 1 throughout)."""
    layout = make_kv_cache_layout(loaded.arch, 16, loaded.dtype, 16 * 1024 * 1024)
    worker = CPUWorker(loaded.model, layout, loaded.dtype)
    blocks = list(range(-(-len(token_ids) // 16)))
    rows = []
    with torch.inference_mode():
        for pos, token in enumerate(token_ids):
            meta, positions = build_attention_metadata([], [(blocks, pos, 1)], 16, None, torch.device("cpu"))
            hidden = loaded.model(torch.tensor([token]), positions, worker.kv_caches, meta)
            rows.append(loaded.model.compute_logits(hidden)[0])
    return torch.stack(rows)


@pytest.mark.slow
def test_embedded_model_on_small_batch_kernels_tracks_float32(smollm_fp32):
    packed = load_model(ModelConfig(dtype="bfloat16"))
    layers = packed.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, SmallBatchLinear)  # Q4_1 in the GGUF
    assert isinstance(layers[0].mlp.down_proj, SmallBatchLinear)
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
