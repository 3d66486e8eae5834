"""GGUF tensor bytes → float32 torch tensors, through the `gguf` package's own numpy dequantizers.

We never hand-write a dequantizer: gguf-py is maintained next to llama.cpp's C kernels, so its numpy
versions are the reference for every block format it knows (Q4_0 … Q8_0, the K-quants, the IQ types).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

import gguf
import numpy as np
import torch

from engine.errors import ModelLoadError, UnsupportedModelError


def dequantize(
    raw: np.ndarray,
    qtype: gguf.GGMLQuantizationType,
    shape: Sequence[int],
    name: str = "<unnamed tensor>",
) -> torch.Tensor:
    """Dequantize one tensor's data as GGUFReader hands it over; `name` only labels errors.

    `shape` is the torch (row-major) shape, i.e. GGUFReader's `tensor.shape` reversed: GGUF lists
    dimensions fastest-first (ne0 = row length), torch lists them slowest-first.
    Returns a float32 tensor that owns its memory (never a view of the memory-mapped file).
    """
    shape = tuple(int(d) for d in shape)
    try:
        qtype = gguf.GGMLQuantizationType(int(qtype))
    except ValueError as e:
        raise UnsupportedModelError(f"tensor {name!r} has unknown GGUF type #{int(qtype)}") from e
    try:
        values = gguf.quants.dequantize(raw, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"tensor {name!r} has GGUF type {qtype.name}, which cannot be dequantized"
        ) from e
    except ValueError as e:  # a byte count that is not a whole number of blocks
        raise ModelLoadError(f"tensor {name!r} ({qtype.name}): corrupt data: {e}") from e
    if values.size != prod(shape):
        raise ModelLoadError(
            f"tensor {name!r} ({qtype.name}) holds {values.size} values, shape {list(shape)} needs {prod(shape)}"
        )
    # NOTE: for F32 gguf returns a view of the read-only mmap; torch wants memory it may write.
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values)

