"""zentorch's ops without its compiler backend: its native library alone.

`import zentorch` registers the ops (`torch.ops.zentorch.*`) by loading libzentorch.so, then imports
its torch.compile backend, and with it torch._dynamo, torch._inductor, sympy and networkx: 1,467
modules, 125 MB of resident memory (RSS after `import torch` 217 MB, after `import zentorch` 342; 2
Zen 3 cores). The zentorch worker calls the ops eagerly and never compiles, so it loads the library
the way zentorch's own `__init__` does and nothing else (+6 MB). Where that does not apply (a
zentorch built for another torch minor version, which the package serves from its stable-ABI
library, or a layout this does not recognise) it imports the package.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

NATIVE_LIBRARY = "libzentorch.so"
BUILD_INFO = "_build_info.py"  # the package's record of the torch it was built against


@functools.cache
def load_zentorch_ops() -> bool:
    """Registers torch.ops.zentorch; False where zentorch is not installed or does not load."""
    try:
        spec = importlib.util.find_spec("zentorch")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = spec.submodule_search_locations[0]
    library = os.path.join(folder, NATIVE_LIBRARY)
    if os.path.exists(library) and _built_torch_minor(folder) == _minor(torch.__version__):
        try:
            # RTLD_GLOBAL as zentorch loads it: its symbols resolve against the torch already loaded.
            ctypes.CDLL(library, mode=os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError as exc:
            log.warning("zentorch's native library did not load (%s); importing the package", exc)
        else:
            if _has_ops():
                return True
    try:
        import zentorch  # noqa: F401  (the whole package: its backend's imports included)
    except Exception:  # noqa: BLE001 - a broken install is the same as none here
        return False
    return _has_ops()


def _has_ops() -> bool:
    return hasattr(torch.ops.zentorch, "zentorch_linear_unary")


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _built_torch_minor(folder: str) -> str | None:
    """The major.minor of `__torchversion__` in the package's build record, read without importing it
    (importing any submodule runs the package's `__init__`)."""
    try:
        with open(os.path.join(folder, BUILD_INFO), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "__torchversion__" and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            return _minor(node.value.value)
    return None
