"""Building and loading zenserve's CPU kernels (engine/kernels/__init__.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from torch.utils import cpp_extension

from engine import kernels


def _build_directory() -> Path:
    """The loaded library's build directory (the cpu_kernels fixture has built it)."""
    [name] = [p.stem for p in map(Path, _loaded_libraries()) if p.name.startswith("zenserve_cpu_kernels_")]
    return Path(cpp_extension._get_build_directory(name, False))


def _loaded_libraries() -> list[str]:
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return sorted({line.split()[-1] for line in f if line.rstrip().endswith(".so")})


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(cpu_kernels):
    # torch's loader would wait on this file forever; a fresh process must clear it and load.
    stale = _build_directory() / "lock"
    stale.touch()
    probe = "import engine.kernels as k; assert k.load_row_argmax() is not None"
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(kernels.__file__).parents[2], timeout=300, check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not stale.exists()
    assert "left by a process that died" in done.stderr


def test_an_installed_package_carries_every_source_and_header_the_build_reads():
    import fnmatch
    import tomllib

    root = Path(kernels.__file__).parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"]
    needed = [*kernels._SOURCES, *kernels._HEADERS]
    assert {p.name for p in Path(kernels.__file__).parent.iterdir() if p.suffix in (".cpp", ".h")} == {p.name for p in needed}
    for path in needed:
        relative = path.relative_to(root / "engine").as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in globs), relative
