"""Read a GGUF file: architecture facts from its metadata, weights as Hugging Face-named tensors.

The file is memory-mapped by `gguf.GGUFReader`; tensors are dequantized one at a time as the
iterator is consumed, so peak memory is the model in the compute dtype plus one float32 tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from engine.config import ModelArchConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loader.dequantize import dequantize
from engine.loader.weights_mapper import WeightsMapper

# general.architecture → the HF class whose weight layout we produce.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# NOTE: llama.cpp's converter permutes the rows of q/k for these (its rope pairs adjacent dims, HF's
# pairs halves); qwen2/qwen3 use NEOX-style rope in llama.cpp and are stored unpermuted.
_QK_PERMUTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})

# blk.{i}.<gguf name>.{weight,bias} → model.layers.{i}.<hf name>.{weight,bias}
_GGUF_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

GGUF_WEIGHTS_MAPPER = WeightsMapper(
    orig_to_new_prefix={
        "token_embd.": "model.embed_tokens.",
        "output_norm.": "model.norm.",
        "output.": "lm_head.",
        # Rope frequency factors: folded into ModelArchConfig.rope_scaling by read_gguf_arch.
        "rope_freqs.": None,
    },
    orig_to_new_regex=[
        # Old converters stored rotary tables; models compute them.
        (r"^blk\.\d+\.attn_rot_embd\b", None),
        *((rf"^blk\.(\d+)\.{g}\.", rf"model.layers.\1.{h}.") for g, h in _GGUF_BLOCK_TENSORS.items()),
    ],
)

# Llama 3.x's published rope scaling; a GGUF stores only the per-frequency factors it implies.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192

_REQUIRED = object()


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file; anything that is not a whole GGUF file raises ModelLoadError naming it."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    # NOTE: GGUFReader parses untrusted bytes with numpy views; a bad or truncated file surfaces as
    # ValueError, IndexError, UnicodeDecodeError…, so any failure to parse means "not a GGUF file".
    # (A short tensor cannot slip through: the reader reshapes every tensor's data to its shape.)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
    return reader


def read_gguf_arch(reader: gguf.GGUFReader) -> ModelArchConfig:
    gguf_arch = _field(reader, "general.architecture")
    architecture = _GGUF_ARCHITECTURES.get(gguf_arch)
    if architecture is None:
        raise UnsupportedModelError(
            f"GGUF architecture {gguf_arch!r} is not supported (supported: {', '.join(_GGUF_ARCHITECTURES)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{gguf_arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    head_dim = meta("attention.key_length", None) or meta("rope.dimension_count", None) or hidden_size // num_heads
    rope_theta = meta("rope.freq_base", 10000.0)
    vocab_size = meta("vocab_size", None) or int(tensors["token_embd.weight"].shape[1])
    max_position_embeddings = meta("context_length")
    rope_scaling = _rope_scaling(reader, gguf_arch, max_position_embeddings)
    if "rope_freqs.weight" in tensors:
        rope_scaling = _llama3_rope_scaling(tensors["rope_freqs.weight"], rope_theta, head_dim)
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=meta("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_theta=rope_theta,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def iter_gguf_weights(
    reader: gguf.GGUFReader, arch: ModelArchConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in `dtype`) for every tensor the model uses, in file order."""
    undo_permute = arch.architecture in _QK_PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        name = GGUF_WEIGHTS_MAPPER.map_name(t.name)
        if name is None:
            continue
        # GGUF shape is [ne0, ne1, ...] (fastest first); torch wants it slowest first.
        weight = dequantize(t.data, t.tensor_type, tuple(reversed(t.shape.tolist())), name=t.name).to(dtype)
        if undo_permute and ".self_attn.q_proj." in name:
            weight = unpermute_qk(weight, arch.num_attention_heads)
        elif undo_permute and ".self_attn.k_proj." in name:
            weight = unpermute_qk(weight, arch.num_key_value_heads)
        yield name, weight


def gguf_weight_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """HF weight name → the GGML type the file stores it in ("Q4_1", "Q8_0", "F32"…)."""
    types = {}
    for t in reader.tensors:
        name = GGUF_WEIGHTS_MAPPER.map_name(t.name)
        if name is not None:
            types[name] = gguf.GGMLQuantizationType(int(t.tensor_type)).name
    return types


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation (its `LlamaModel.permute`).

    llama.cpp: w.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape),
    i.e. per head it interleaves the two rotary halves (row j of half a lands at row 2j + a).
    Works for weights [rows, in] and biases [rows]; pass num_key_value_heads for k.
    """
    rows, rest = weight.shape[0], weight.shape[1:]
    half = rows // num_heads // 2
    # [heads * half * 2, *rest] → [heads, half, 2, *rest] → [heads, 2, half, *rest] → [rows, *rest]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def _rope_scaling(reader: gguf.GGUFReader, gguf_arch: str, max_position_embeddings: int) -> RopeScaling:
    rope_type = _field(reader, f"{gguf_arch}.rope.scaling.type", None)
    factor = _field(reader, f"{gguf_arch}.rope.scaling.factor", None)
    if rope_type is None and (linear := _field(reader, f"{gguf_arch}.rope.scale_linear", None)):
        rope_type, factor = "linear", linear  # the key older converters wrote
    if rope_type in (None, "none") or factor in (None, 1.0):
        return RopeScaling()
    if rope_type not in ("linear", "yarn"):
        raise UnsupportedModelError(f"GGUF rope scaling type {rope_type!r} is not supported")
    original = _field(reader, f"{gguf_arch}.rope.scaling.original_context_length", None)
    return RopeScaling(rope_type=rope_type, factor=factor, original_max_position_embeddings=original)


def _llama3_rope_scaling(rope_freqs: Any, rope_theta: float, head_dim: int) -> RopeScaling:
    """Llama 3.x GGUFs carry their rope scaling only as per-frequency divisors (`rope_freqs.weight`).

    Recover RopeScaling by recomputing the divisors from Llama 3's published parameters and the largest
    stored divisor (the factor); refuse the file rather than run it with different positions.
    """
    stored = np.asarray(dequantize(rope_freqs.data, rope_freqs.tensor_type, (head_dim // 2,), "rope_freqs.weight"))
    factor = float(stored.max())
    low_freq_wavelen = _LLAMA3_ORIGINAL_CONTEXT / _LLAMA3_LOW_FREQ_FACTOR
    high_freq_wavelen = _LLAMA3_ORIGINAL_CONTEXT / _LLAMA3_HIGH_FREQ_FACTOR
    expected = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * rope_theta ** (2 * i / head_dim)
        if wavelen < high_freq_wavelen:
            expected.append(1.0)
        elif wavelen > low_freq_wavelen:
            expected.append(factor)
        else:
            smooth = (_LLAMA3_ORIGINAL_CONTEXT / wavelen - _LLAMA3_LOW_FREQ_FACTOR) / (
                _LLAMA3_HIGH_FREQ_FACTOR - _LLAMA3_LOW_FREQ_FACTOR
            )
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(stored, np.asarray(expected, dtype=np.float32), rtol=1e-4):
        raise UnsupportedModelError("GGUF rope_freqs.weight does not match Llama 3 rope scaling")
    return RopeScaling(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )


def _field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    value = field.contents()
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        raise UnsupportedModelError(f"GGUF metadata {key!r} is per-layer, which is not supported")
    if field.types[0] == gguf.GGUFValueType.FLOAT32:
        # float32 1e-5 is 9.99999974e-06 as a Python float; the shortest decimal is what config.json says.
        value = float(str(np.float32(value)))
    return value
