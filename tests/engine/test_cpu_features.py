"""What the engine reads off the CPU to pick its paths (engine/cpu_features.py)."""

from __future__ import annotations

import pytest

from engine.cpu_features import cpu_flags, cpu_identity, is_amd_zen, splits_256_bit_vectors


def _identity(vendor: str, family: int, model: int) -> dict[str, str]:
    return {"vendor_id": vendor, "cpu family": str(family), "model": str(model)}


@pytest.mark.parametrize("identity,splits", [
    (_identity("AuthenticAMD", 23, 0x01), True),   # Zen 1 (EPYC 7001, "Naples")
    (_identity("AuthenticAMD", 23, 0x08), True),   # Zen+ (Ryzen 2000)
    (_identity("AuthenticAMD", 23, 0x31), False),  # Zen 2 (EPYC 7002): full-width 256-bit units
    (_identity("AuthenticAMD", 25, 0x01), False),  # Zen 3
    (_identity("AuthenticAMD", 26, 0x02), False),  # Zen 5
    (_identity("GenuineIntel", 6, 0x01), False),   # an Intel family-6 part with a low model number
    ({}, False),                                   # /proc/cpuinfo unreadable
    ({"vendor_id": "AuthenticAMD", "cpu family": "23", "model": "?"}, False),
])
def test_only_zen_and_zen_plus_split_256_bit_vectors(identity, splits):
    assert splits_256_bit_vectors(identity) is splits


@pytest.mark.parametrize("identity,zen", [
    (_identity("AuthenticAMD", 23, 0x01), True),   # Zen 1
    (_identity("AuthenticAMD", 25, 0x01), True),   # Zen 3
    (_identity("AuthenticAMD", 26, 0x02), True),   # Zen 5
    (_identity("AuthenticAMD", 21, 0x02), False),  # Bulldozer-era (family 0x15)
    (_identity("GenuineIntel", 6, 0x8F), False),   # a Xeon
    ({}, False),                                   # /proc/cpuinfo unreadable
    ({"vendor_id": "AuthenticAMD", "cpu family": "?", "model": "1"}, False),
])
def test_zen_is_amd_from_family_23_on(identity, zen):
    assert is_amd_zen(identity) is zen


def test_the_identity_is_read_from_proc_cpuinfo():
    identity = cpu_identity()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        assert identity == {}
        return
    assert identity.get("vendor_id", "") in first
    flags = next((line for line in first.splitlines() if line.startswith("flags")), "flags:").split(":", 1)[1]
    assert cpu_flags() == frozenset(flags.split())
    assert splits_256_bit_vectors() is splits_256_bit_vectors(identity)
    assert is_amd_zen() is is_amd_zen(identity)
