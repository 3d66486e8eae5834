"""The KV cache's dtypes (`CacheConfig.kv_cache_dtype`, `--kv-cache-dtype`), and the int8 cache's row format.

"model" keeps the model's dtype. "fp8" (or "fp8_e4m3", as vLLM names it) stores a bf16 model's rows as float8
e4m3fn, one byte a value with no scale: rounded to nearest even and saturated at +-448 by torch's cast (and by
the kernels, which use the same conversion), widened exactly to bf16 as the attention kernels read them. It
holds twice the tokens of bf16 in the same memory; on AMX its decode attention takes 0.78-0.83x bf16's time
(BENCHMARKS.md), and it serves on AVX-512 CPUs, as vLLM's CPU backend does. "float16" stores a float32 model's K and V rows as float16 (half the
bytes, rounded to nearest even as torch's cast does; the attention kernels widen them as they read them):
as llama.cpp's default f16 cache, the next-token KL from a float32 cache is ~1e-6, and decode attention
reads half the bytes. "auto" is float16 for a float32 model on the CPU workers, the model's dtype
elsewhere. "int8" stores rows as follows.

Each head's K or V row of one token is stored as `head_size` int8 values followed by the 4 bytes of
a float32 scale: value = q * scale, with scale = max|x| / 127 over the row. A cache is then
[num_slots, KV heads, head_size + 4] int8, about half the bytes of bfloat16 (68 against 128 for a head
of 64), so it holds about twice the tokens and decode attention reads half the memory.

Keeping the scale inside the row keeps one tensor per layer for K and for V: the offload tiers copy
cache rows as bytes and need no second array. engine/kernels/paged_decode_attention.cpp reads and
writes the same format and quantizes exactly as `quantize_rows` does, so a row does not depend on
which path wrote it.
"""

from __future__ import annotations

import torch

from engine.errors import ConfigError

KV_CACHE_DTYPES = ("auto", "model", "float16", "int8", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
SCALE_BYTES = 4  # a float32 scale after each row's values
_INV_127 = 1.0 / 127.0  # as a float32 constant, as the kernel computes it


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, cpu_worker: bool) -> torch.dtype:
    """The cache tensors' dtype for a `kv_cache_dtype` setting, the model's compute dtype and the worker."""
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return _fp8_cache_dtype(model_dtype, cpu_worker)
    if kv_cache_dtype == "auto":
        return torch.float16 if model_dtype == torch.float32 and cpu_worker else model_dtype
    if kv_cache_dtype == "float16":
        if model_dtype not in (torch.float32, torch.float16):
            raise ConfigError(f"a float16 KV cache serves float32 models (the kernels widen its rows to float32); "
                              f"this model computes in {str(model_dtype).removeprefix('torch.')}, whose own cache "
                              f"is already 2 bytes a value: use --kv-cache-dtype model or int8")
        return torch.float16
    return model_dtype


def _fp8_cache_dtype(model_dtype: torch.dtype, cpu_worker: bool) -> torch.dtype:
    from engine.cpu_features import has_avx512  # looked up per call, as the CPU-feature tests patch it

    if not cpu_worker:
        raise ConfigError("the fp8 KV cache runs on the CPU workers only")
    if model_dtype != torch.bfloat16:
        raise ConfigError(f"the fp8 KV cache serves bfloat16 models (its kernels widen rows to bf16); this model "
                          f"computes in {str(model_dtype).removeprefix('torch.')}: use --dtype bfloat16, or "
                          f"--kv-cache-dtype int8")
    if not has_avx512():
        raise ConfigError("the fp8 KV cache needs a CPU with AVX-512 (its attention kernels widen float8 rows "
                          "there); use --kv-cache-dtype int8")
    return FP8_DTYPE


def cache_row_size(head_size: int, kv_dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of `kv_dtype`."""
    return head_size + SCALE_BYTES if kv_dtype == torch.int8 else head_size


def is_int8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A float8 tensor viewed as uint8 (torch's CPU index_select and index_copy_ take no float8); others as they are."""
    return cache.view(torch.uint8) if cache.dtype == FP8_DTYPE else cache


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_size] float -> [..., head_size + 4] int8 rows with their scales."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: one IEEE division, as in the kernel (`127.0 / absmax` would be
    # torch's reciprocal times 127, which rounds twice).
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)
    scale = (absmax * _INV_127).contiguous()
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_size + 4] int8 rows -> [..., head_size] in `dtype` (computed in float32)."""
    head_size = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_size:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_size].float() * scale).to(dtype)
