"""zenserve's own CPU kernels, compiled on first use for the machine they run on: decode attention
read in place from the paged cache (bf16 or int8 rows), few-row GEMMs on Q8_0 and (for float32
models) Q4_1 weights as the checkpoint stores them, bf16 GEMMs on AVX512_BF16 and, over oneDNN's
blocked weights, on AMX, oneDNN's bf16 linear with its rows shared out among the threads, the gated
MLP's activation in one pass, and greedy decoding's argmax.

They are built with torch's C++ extension loader (g++ and ninja; the build is cached under
TORCH_EXTENSIONS_DIR: 81 s the first time on 2 cores here, a load afterwards). A machine without a
compiler serves on the torch fallbacks: `load_paged_decode_attention` returns None and says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.cpu_features import cpu_identity

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).with_name(name) for name in (
    "paged_decode_attention.cpp", "paged_prefill_attention.cpp", "int8_group_mm.cpp", "int4_group_mm.cpp",
    "int4_tile_mm.cpp", "int8_tile_mm.cpp",
    "silu_and_mul.cpp", "rotary_embedding.cpp",
    "row_argmax.cpp", "bf16_linear.cpp", "rms_norm.cpp", "onednn_rows.cpp", "blocked_tile_linear.cpp", "decode_layers.cpp",
    "int8_rows.cpp", "write_kv_rows.cpp")]
_HEADERS = [Path(__file__).with_name(name) for name in ("cache_rows.h", "fp8_rows.h", "byte_tables.h", "bf16_bits.h", "amx_tiles.h", "group_dot_rows.h", "group_tiles.h", "avx512_exp.h", "rope_row.h", "reduce16.h")]  # included by the sources: part of the build's name
# -march=native: the kernels are built where they run. -ffast-math lets exp vectorize (glibc's vector
# expf); the kernels keep its arguments finite and in range (softmax: <= 0; silu: capped at 88).
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_lock = threading.Lock()
_loaded: dict[str, bool] = {}  # "library" -> whether it built and loaded

# (q [D, H, hd], k_cache, v_cache [slots, KVH, hd] in q's dtype (or float16 under float32, or float8 e4m3fn) or int8 rows [slots, KVH, hd + 4]
#  (engine/kv_quant.py), slots [D, L] int64, context_lens [D] int64, window (0: none), scale) -> [D, H, hd]
PagedDecodeAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]
# (q [T, H, hd] bf16 or float32, k_cache, v_cache as above, slots [start + T] int64, start, window (0: none),
#  scale) -> [T, H, hd]: a prefill chunk's causal attention, head sizes 64 and 128
PagedPrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor]
# (qkv [D, (H + 2 KVH) * hd], cos, sin [max_positions, hd] float32, positions [D], k_cache, v_cache,
#  write_slots [D], slots [D, L], context_lens [D], num_heads, window, scale) -> [D, H * hd]
DecodeAttentionBlock = Callable[..., torch.Tensor]
# (k_cache, v_cache [slots, KVH, D], k, v [T, KVH, D] of the caches' dtype, slots [T] int64) -> None
WriteKvRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (x [M, K] bf16, packed weight, bias [N] float32 or None) -> [M, N] bf16
Bf16Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# ((x [T, D], weight [D] float32, eps) -> [T, D], (x, residual, weight, eps) -> None: residual += x and
#  x = rms_norm(residual) in place)
RmsNormKernels = tuple[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
                       Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]]
# (x [M, K], q [N, K] int8, scales [N, K / 32] float32) -> [M, N] in x's dtype
Int8GroupMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x [M, K], packed [N, K / 2] uint8, d, mins [N, K / 32] float32) -> [M, N]: w = q * d + m, Q4_1's groups
Int4GroupMm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# (x [T, N, hd] (hd contiguous), cos, sin [T, hd] float32: each row's table entries) -> x, rotated in place
RotaryEmbedding = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (x [M, K] bf16, packed [N / 16, K / 32, 320] uint8) -> [M, N] bf16: Q4_0/Q4_1 weights, float16 d and m
Int4TileMm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (x [M, K] bf16, packed [N / 16, K / 32, 576] uint8) -> [M, N] bf16: Q8_0 weights on AMX's tiles
Int8TileMm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (x [M, K] bf16, weight in oneDNN's blocked layout, bias [N] bf16 or None) -> [M, N] bf16
OneDnnSplitRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
# (x [M, K] bf16, the weight in oneDNN's blocked layout, bias [N] or None) -> [M, N] bf16, on AMX's tiles
BlockedTileLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def load_paged_decode_attention() -> PagedDecodeAttention | None:
    """torch.ops.zenserve.paged_decode_attention, built if needed; None where it cannot be built
    (or ZENSERVE_NO_CPU_KERNELS=1, which keeps the torch path)."""
    return torch.ops.zenserve.paged_decode_attention if _ensure_built() else None


def paged_decode_attention_uses_amx() -> bool:
    """Whether paged_decode_attention runs bf16 queries over a bf16 cache with 64-wide heads on AMX's
    tiles here (an Intel Xeon since Sapphire Rapids)."""
    return load_paged_decode_attention() is not None and bool(torch.ops.zenserve.paged_decode_attention_uses_amx())


def load_decode_attention_block() -> DecodeAttentionBlock | None:
    """torch.ops.zenserve.decode_attention_block (rotary embedding, the cache write and decode attention
    in one call), on the same terms as load_paged_decode_attention."""
    return torch.ops.zenserve.decode_attention_block if _ensure_built() else None


def load_decode_layers() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """torch.ops.zenserve.decode_layers (a decode-only step's decoder layers in one call: see
    engine/models/decode_layers.py), on the same terms as load_paged_decode_attention."""
    return torch.ops.zenserve.decode_layers if _ensure_built() else None


def load_paged_prefill_attention() -> PagedPrefillAttention | None:
    """torch.ops.zenserve.paged_prefill_attention (a prefill chunk's causal attention read in place from
    the paged cache), on the same terms; None also where the CPU has neither AVX-512 nor AVX2 with FMA."""
    if not _ensure_built() or not torch.ops.zenserve.paged_prefill_attention_supported():
        return None
    return torch.ops.zenserve.paged_prefill_attention


def paged_prefill_attention_uses_amx() -> bool:
    """Whether paged_prefill_attention runs bf16 queries over a bf16 cache on AMX's tiles here (flash
    attention by blocks of 32 keys, for any context length)."""
    return load_paged_prefill_attention() is not None and bool(torch.ops.zenserve.paged_prefill_attention_uses_amx())


def paged_prefill_attention_scores_bf16() -> bool:
    """Whether paged_prefill_attention scores bf16 queries over a bf16 or float8 cache on VDPBF16PS here
    (AVX512_BF16), where AMX does not serve them."""
    return load_paged_prefill_attention() is not None and bool(torch.ops.zenserve.paged_prefill_attention_scores_bf16())


def load_int8_group_mm() -> Int8GroupMm | None:
    """torch.ops.zenserve.int8_group_mm (a few rows times a Q8_0-layout weight), on the same terms."""
    return torch.ops.zenserve.int8_group_mm if _ensure_built() else None


def load_int4_group_mm() -> tuple[Callable[[torch.Tensor], torch.Tensor], Int4GroupMm] | None:
    """(torch.ops.zenserve.int4_group_pack, torch.ops.zenserve.int4_group_mm): a few float32 rows times a
    Q4_1-layout weight, on the same terms."""
    return (torch.ops.zenserve.int4_group_pack, torch.ops.zenserve.int4_group_mm) if _ensure_built() else None


def load_int4_group_mm_q8() -> Int4GroupMm | None:
    """torch.ops.zenserve.int4_group_mm_q8: int4_group_mm with each group of 32 of x quantized to int8 and
    the products summed in integers (not exact; int8 activations, opt-in), on the same terms."""
    return torch.ops.zenserve.int4_group_mm_q8 if _ensure_built() else None


def load_int4_group_dequantize() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """torch.ops.zenserve.int4_group_dequantize (int4_group_pack's packed weight, d and mins written out as
    its dense float32 values into a given [N, K] tensor), on the same terms."""
    return torch.ops.zenserve.int4_group_dequantize if _ensure_built() else None


def load_silu_and_mul() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch.ops.zenserve.silu_and_mul ([T, 2 I] -> silu(gate) * up), on the same terms."""
    return torch.ops.zenserve.silu_and_mul if _ensure_built() else None


# (x [T, K] float32, inv_smooth [K], levels) -> (q [T, K] uint8, low [T], step [T]);
# (y [T, N] in place, step, low, sums [N], bias [N] or None) -> None
Int8Rows = tuple[Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], None]]


def load_int8_rows() -> Int8Rows | None:
    """(torch.ops.zenserve.quantize_rows, torch.ops.zenserve.rescale_rows_): a float32 model's activation rows
    onto 0..levels for oneDNN's int8 GEMM, and its output back on their scale (engine/models/int8_linear.py),
    on the same terms."""
    return (torch.ops.zenserve.quantize_rows, torch.ops.zenserve.rescale_rows_) if _ensure_built() else None


def load_rotary_embedding() -> RotaryEmbedding | None:
    """torch.ops.zenserve.rotary_embedding_ (a prefill step's q and k rotated in place), on the same terms."""
    return torch.ops.zenserve.rotary_embedding_ if _ensure_built() else None


def load_write_kv_rows() -> WriteKvRows | None:
    """torch.ops.zenserve.write_kv_rows_ (a step's keys and values into the cache's slots, for caches of the
    rows' own dtype), on the same terms."""
    return torch.ops.zenserve.write_kv_rows_ if _ensure_built() else None


def load_row_argmax() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch.ops.zenserve.row_argmax ([B, V] float32 or bfloat16 -> [B] int64, torch.argmax's result), on the same
    terms."""
    return torch.ops.zenserve.row_argmax if _ensure_built() else None


def load_rms_norm() -> RmsNormKernels | None:
    """(torch.ops.zenserve.rms_norm, torch.ops.zenserve.add_rms_norm_), on the same terms."""
    return (torch.ops.zenserve.rms_norm, torch.ops.zenserve.add_rms_norm_) if _ensure_built() else None


def load_bf16_linear() -> tuple[Callable[[torch.Tensor], torch.Tensor], Bf16Linear] | None:
    """(torch.ops.zenserve.bf16_pack_weight, torch.ops.zenserve.bf16_linear): few-to-many-row bf16 GEMMs
    on AVX512_BF16 with the weight packed once; None where the kernels cannot be built or the CPU has
    no AVX512_BF16."""
    if not _ensure_built() or not torch.ops.zenserve.bf16_linear_supported():
        return None
    return torch.ops.zenserve.bf16_pack_weight, torch.ops.zenserve.bf16_linear


def load_int4_tile_mm() -> tuple[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], Int4TileMm] | None:
    """(torch.ops.zenserve.int4_tile_pack, torch.ops.zenserve.int4_tile_mm): a bf16 model's few-row calls
    on its 4-bit GGUF weights, on AVX512_BF16; None where the kernels cannot be built or the CPU has no
    AVX512_BF16."""
    if not _ensure_built() or not torch.ops.zenserve.int4_tile_mm_supported():
        return None
    return torch.ops.zenserve.int4_tile_pack, torch.ops.zenserve.int4_tile_mm


def load_int4_tile_dequantize() -> Callable[[torch.Tensor, torch.Tensor], None] | None:
    """torch.ops.zenserve.int4_tile_dequantize (int4_tile_pack's weights written out as bf16, into an [N, K]
    tensor or a oneDNN blocked one); None where int4_tile_mm is not available."""
    return torch.ops.zenserve.int4_tile_dequantize if load_int4_tile_mm() is not None else None


def load_int8_tile_mm() -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Int8TileMm] | None:
    """(torch.ops.zenserve.int8_tile_pack, torch.ops.zenserve.int8_tile_mm): a bf16 model's decode-sized
    calls on its Q8_0 GGUF weights, on AMX's tiles, or on AVX512_BF16 where the CPU (or the kernel's
    permission) gives no AMX; None where the kernels cannot be built or the CPU has neither."""
    if not _ensure_built() or not torch.ops.zenserve.int8_tile_mm_supported():
        return None
    return torch.ops.zenserve.int8_tile_pack, torch.ops.zenserve.int8_tile_mm


def int8_tile_mm_uses_amx() -> bool:
    """Whether int8_tile_mm runs on AMX's tiles here (elsewhere on AVX512_BF16, which pays at fewer rows)."""
    return load_int8_tile_mm() is not None and bool(torch.ops.zenserve.int8_tile_mm_uses_amx())


def load_onednn_linear_split_rows() -> OneDnnSplitRows | None:
    """torch.ops.zenserve.onednn_linear_split_rows (oneDNN's bf16 linear with the rows shared out among the
    threads); None where the kernels cannot be built."""
    return torch.ops.zenserve.onednn_linear_split_rows if _ensure_built() else None


def load_blocked_tile_linear() -> BlockedTileLinear | None:
    """torch.ops.zenserve.blocked_tile_linear (a bf16 GEMM on AMX's tiles over the weight in oneDNN's blocked
    layout, for prefill-sized calls); None where the kernels cannot be built or the CPU has no AMX."""
    if not _ensure_built() or not torch.ops.zenserve.blocked_tile_linear_supported():
        return None
    return torch.ops.zenserve.blocked_tile_linear


def int4_tile_mm_uses_amx() -> bool:
    """Whether int4_tile_mm runs its calls of 3 rows and more on AMX's tiles here (an Intel Xeon since
    Sapphire Rapids, the kernels built for it and the tiles granted to this process)."""
    return load_int4_tile_mm() is not None and bool(torch.ops.zenserve.int4_tile_mm_uses_amx())


def _ensure_built() -> bool:
    if os.environ.get("ZENSERVE_NO_CPU_KERNELS") == "1":
        return False
    with _lock:
        if "library" not in _loaded:
            _loaded["library"] = _build()
        return _loaded["library"]


def _build() -> bool:
    from torch.utils import cpp_extension

    # The name carries the source, the flags and the CPU: a cache directory shared between machines
    # never hands one a build for another's instruction set.
    sources = b"".join(path.read_bytes() for path in [*_SOURCES, *_HEADERS])
    digest = hashlib.sha256(sources + " ".join(_CFLAGS).encode() + _cpu_model().encode()).hexdigest()[:12]
    name = f"zenserve_cpu_kernels_{digest}"
    try:
        # NOTE: a private helper, but the directory whose lock file torch's loader waits on.
        build_directory = Path(cpp_extension._get_build_directory(name, False))
        with _build_lock(build_directory):
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: serve on torch ops
        log.warning("CPU kernels not built, their callers fall back to torch and zentorch ops: %s", e)
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_directory: Path) -> Iterator[None]:
    """Serializes zenserve processes building or loading the kernels, and clears a lock torch left.

    torch's loader marks a build with a plain `lock` file and waits, forever, while one exists: a
    process killed mid-build (SIGKILL, or a container stopped with SIGTERM) leaves it behind and
    every later start hangs at "loading". An flock is released by the kernel when its holder dies, so
    whoever holds this one knows no other zenserve process is inside torch's loader for this build,
    and a `lock` file still there is stale."""
    with open(build_directory / "zenserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a process that died while building the CPU kernels", stale)
            stale.unlink(missing_ok=True)
        yield


def _cpu_model() -> str:
    """The first CPU's model name and flags: kernels built with -march=native are built again on another CPU."""
    identity = cpu_identity()
    return f"{identity.get('model name', '')}\n{identity.get('flags', '')}"
