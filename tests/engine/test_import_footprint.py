"""The engine's resident footprint: what building and stepping it imports.

torch._dynamo, torch._inductor and sympy hold about 118 MB of Python objects once imported; the engine
never compiles, but `import zentorch`, math on meta tensors and `Module.to_empty` each import them
(engine/worker/zentorch_ops.py, engine/loader/load.py). Checked in a fresh interpreter: the test
process itself has imported them (transformers does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.worker.zentorch_ops import _built_torch_minor, _minor, load_zentorch_ops

REPO = Path(__file__).resolve().parents[2]
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "sympy")

PROBE = """
import json, sys
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.core import EngineCore
from engine.request import SamplingParams

core = EngineCore(EngineConfig(model=ModelConfig(compact_weights={compact}),
                               cache=CacheConfig(kv_cache_memory_bytes=64 << 20), worker="{worker}"))
core.add_request("a", list(range(100, 400)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
core.add_request("b", list(range(500, 520)), SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4, ignore_eos=True))
while core.has_unfinished():
    core.step()
print(json.dumps({{"worker": core.worker.name, "modules": sorted(m for m in {modules!r} if m in sys.modules),
                  "zentorch_package": "zentorch" in sys.modules}}))
"""


def _probe(worker: str, compact: bool) -> dict:
    code = PROBE.format(worker=worker, compact=compact, modules=COMPILER_MODULES)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("compact", [False, True], ids=["dense", "compact"])
def test_eager_engine_imports_no_compiler(compact):
    seen = _probe("eager", compact)
    assert seen["modules"] == [] and not seen["zentorch_package"], seen


@pytest.mark.skipif(not load_zentorch_ops(), reason="zentorch is not installed")
def test_zentorch_engine_runs_on_the_native_library_alone():
    seen = _probe("zentorch", False)
    assert seen["worker"] == "zentorch"
    assert seen["modules"] == [] and not seen["zentorch_package"], seen


def test_build_record_is_read_without_importing(tmp_path):
    (tmp_path / "_build_info.py").write_text('__version__ = "2.13.0.2"\n__torchversion__ = "2.13.0+cpu"\n')
    assert _built_torch_minor(str(tmp_path)) == "2.13"
    (tmp_path / "_build_info.py").write_text("__torchversion__ = version()\n")  # not a literal: unknown
    assert _built_torch_minor(str(tmp_path)) is None
    assert _built_torch_minor(str(tmp_path / "missing")) is None
    assert _minor("2.10.1+cpu") == "2.10" and _minor("2.13.0") == "2.13"
