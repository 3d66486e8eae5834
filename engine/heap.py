"""Return the C heap's free pages to the kernel after large one-off work (loading a model).

glibc keeps freed memory for reuse: freeing a block it had mapped on its own raises its mmap
threshold (up to 32 MB), so later blocks of that size come from the heap and stay resident when
freed. Loading SmolLM2-135M left about 300 MB resident that nothing used (BENCHMARKS.md) until
malloc_trim gave it back. Other C libraries (musl) have no malloc_trim: then this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)


def release_free_heap() -> bool:
    """malloc_trim(0) where the C library has it; whether it ran."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
