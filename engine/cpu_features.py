"""What this CPU can run, from the flags /proc/cpuinfo lists (read once: they do not change).

zentorch builds for every Zen, but some of its kernels need instructions older Zens lack: on a Zen 3
(AVX2, no AVX-512) its bf16 GEMMs raise ("needs the cpu support avx512bf16") and its int8 GEMM kills
the process with an illegal instruction. The engine asks here before it picks those paths.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags; empty where /proc/cpuinfo cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_avx2() -> bool:
    """AVX2 (every x86-64 Zen): where zenserve's float32 kernels take their vector paths."""
    return "avx2" in cpu_flags()


def has_avx512() -> bool:
    """AVX-512 Foundation (Zen 4 and later, Intel Xeons): where zentorch's own kernels take their fast paths."""
    return "avx512f" in cpu_flags()


def has_native_bf16() -> bool:
    """bf16 dot products in hardware (AVX512_BF16 or AMX): where bf16 compute is faster than float32,
    and what zentorch's bf16 GEMMs require."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def has_avx512_bf16() -> bool:
    """AVX512_BF16 (Zen 4 and later, Intel Xeons since Cooper Lake): where zenserve's bf16 kernels take
    their vector paths."""
    return "avx512_bf16" in cpu_flags()


def has_amx_bf16() -> bool:
    """AMX with bf16 tiles (Intel Xeon since Sapphire Rapids): where oneDNN's bf16 GEMMs beat
    zenserve's AVX512_BF16 kernel 2.5-8x at 16-286 rows (engine/models/onednn_linear.py)."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags


def has_avx512_vnni() -> bool:
    """AVX512-VNNI: what zentorch's int8 GEMM (int8 activations) requires."""
    return "avx512_vnni" in cpu_flags()
