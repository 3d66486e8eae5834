"""pyproject.toml is the one source of the torch and zentorch pins; the Makefile, the Dockerfiles and the
ops/ files install the same versions or defer to it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO_ROOT = Path(__file__).resolve().parents[2]
# Files that install torch or zentorch, or that could pass a version to something that does.
INSTALLERS = [
    "Makefile",
    "docker/Dockerfile.cpu",
    "docker/Dockerfile.zen",
    *sorted(f"ops/{p.name}" for p in (REPO_ROOT / "ops").iterdir() if p.is_file()),
]
_PIN = re.compile(r"(?<![\w-])(torch|zentorch)==([0-9][\w.+]*)")


def _exact_pin(requirements: list[str], name: str) -> str:
    (req,) = [Requirement(r) for r in requirements if Requirement(r).name == name]
    (spec,) = req.specifier
    assert spec.operator == "==", f"{name} is pinned exactly in pyproject.toml, not {spec}"
    return spec.version


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def pins(project) -> dict[str, str]:
    return {
        "torch": _exact_pin(project["dependencies"], "torch"),
        "zentorch": _exact_pin(project["optional-dependencies"]["zen"], "zentorch"),
    }


def _arg_default(args: list[str], name: str) -> str | None:
    (arg,) = [a for a in args if a.partition("=")[0] == name]
    return arg.partition("=")[2] or None


@pytest.mark.parametrize("path", INSTALLERS)
def test_every_literal_pin_matches_pyproject(pins, path):
    for name, version in _PIN.findall((REPO_ROOT / path).read_text()):
        assert version == pins[name], f"{path} pins {name}=={version}; pyproject.toml says {pins[name]}"


def test_makefile_installs_pyprojects_torch_first(pins):
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert f'install --quiet "torch=={pins["torch"]}"' in makefile


def test_cpu_dockerfile_installs_torch_from_its_pinned_arg(cpu_dockerfile, pins):
    base = cpu_dockerfile.stages[0]
    assert _arg_default(base.find("ARG"), "TORCH_VERSION") == pins["torch"]
    assert any('"torch==${TORCH_VERSION}"' in run for run in base.find("RUN"))


def test_zen_dockerfile_leaves_the_zentorch_pin_to_the_zen_extra(zen_dockerfile):
    zen_base = zen_dockerfile.stage("zen-base")
    # No default: an unset ZENTORCH_VERSION means pyproject's `zen` extra decides.
    assert _arg_default(zen_base.find("ARG"), "ZENTORCH_VERSION") is None
    (install,) = [run for run in zen_base.find("RUN") if "zentorch==" in run]
    assert '"zentorch==${ZENTORCH_VERSION}"' in install
    assert '"/opt/zenserve[zen]"' in install


def test_cpu_dockerfile_python_satisfies_requires_python(cpu_dockerfile, project):
    python = _arg_default(cpu_dockerfile.global_args, "PYTHON_VERSION")
    assert python in SpecifierSet(project["requires-python"])
    assert cpu_dockerfile.stages[0].base == "python:${PYTHON_VERSION}-slim"
