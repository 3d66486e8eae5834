"""Projected image features by mm_hash, kept between the steps that prefill one image.

Chunked prefill may spread an image's placeholders over several steps: the tower runs once, at the first
chunk, and later chunks read from here. An entry is dropped once a chunk reaches the image's end; what a
request leaves behind (aborted, preempted mid-image) ages out under the byte bound. A miss only costs a
re-encode, never correctness.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


class EncoderCache:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # engines sharing one loaded model run on different threads
        self.num_encoded = 0  # images run through the tower, for tests and metrics

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        with self._lock:
            features = self._entries.get(mm_hash)
            if features is not None:
                self._entries.move_to_end(mm_hash)
            return features

    def put(self, mm_hash: str, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        with self._lock:
            self.num_encoded += 1
            if mm_hash in self._entries:
                self._bytes -= _nbytes(self._entries.pop(mm_hash))
            self._entries[mm_hash] = features
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, old = self._entries.popitem(last=False)
                self._bytes -= _nbytes(old)

    def drop(self, mm_hash: str) -> None:
        with self._lock:
            features = self._entries.pop(mm_hash, None)
            if features is not None:
                self._bytes -= _nbytes(features)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
