"""What this CPU can run, from the flags /proc/cpuinfo lists (read once: they do not change).

zentorch builds for every Zen, but some of its kernels need instructions older Zens lack: on a Zen 3
(AVX2, no AVX-512) its bf16 GEMMs raise ("needs the cpu support avx512bf16") and its int8 GEMM kills
the process with an illegal instruction. The engine asks here before it picks those paths.
"""

from __future__ import annotations

import functools


@functools.cache
def cpu_identity() -> dict[str, str]:
    """The first CPU's /proc/cpuinfo fields (vendor_id, cpu family, model, flags, ...); empty where it
    cannot be read (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if not line.strip():  # the first CPU's block ends
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags; empty where /proc/cpuinfo cannot be read."""
    return frozenset(cpu_identity().get("flags", "").split())


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


def _amd_family_and_model(identity: dict[str, str] | None) -> tuple[int, int] | None:
    """(cpu family, model) of an AMD CPU; None for another vendor or fields that do not parse."""
    fields = cpu_identity() if identity is None else identity
    if fields.get("vendor_id") != "AuthenticAMD":
        return None
    try:
        return int(fields.get("cpu family", "")), int(fields.get("model", ""))
    except ValueError:
        return None


def is_amd_zen(identity: dict[str, str] | None = None) -> bool:
    """An AMD Zen of any generation (family 23, 0x17, and later): where zentorch runs and `auto` picks
    the zentorch worker. `identity`: /proc/cpuinfo's fields (cpu_identity()), for tests."""
    found = _amd_family_and_model(identity)
    return found is not None and found[0] >= 23


def splits_256_bit_vectors(identity: dict[str, str] | None = None) -> bool:
    """An AMD Zen or Zen+ (family 23, models below 0x30): its FP units are 128 bits wide, so every AVX2
    operation takes two passes. zenserve's float32 group kernel, which widens and converts 4-bit weights
    before its FMAs, then loses to a prepacked float32 GEMM at fewer rows than on a Zen 2 or later
    (engine/worker/cpu.py). `identity`: /proc/cpuinfo's fields (cpu_identity()), for tests."""
    found = _amd_family_and_model(identity)
    return found is not None and found[0] == 23 and found[1] < 0x30
