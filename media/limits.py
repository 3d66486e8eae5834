"""Limits applied to every media item, whatever its source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaLimits:
    """Caps on one fetch and one decode. Validated on construction (no I/O)."""

    max_bytes: int = 20 * 1024 * 1024  # encoded size: download, data URL payload or local file
    max_pixels: int = 50_000_000  # width * height, checked from the header before any pixel is decoded
    connect_timeout: float = 3.0  # seconds to establish one TCP (+TLS) connection
    total_timeout: float = 10.0  # seconds for the whole download, every redirect hop included
    max_redirects: int = 3  # hops followed; each one is checked like the first URL
    decode_timeout: float = 30.0  # seconds one decode may take in a decode process before it is killed

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {self.max_bytes}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be positive, got {self.max_pixels}")
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be positive, got {self.connect_timeout}")
        if not self.total_timeout > 0:
            raise ValueError(f"total_timeout must be positive, got {self.total_timeout}")
        if not self.decode_timeout > 0:
            raise ValueError(f"decode_timeout must be positive, got {self.decode_timeout}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be non-negative, got {self.max_redirects}")
