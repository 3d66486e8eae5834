"""Fixtures for the image and pipeline checks: the repository root, parsed Dockerfiles, and fake
`docker`/`pip` commands that record their arguments (no Docker engine exists on these machines)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# One JSON line per invocation: {"argv": [...], "cwd": "..."}. `pip freeze` prints FAKE_PIP_FREEZE.
_RECORDER = """\
import json, os, sys
with open(os.environ["FAKE_CMD_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd()}) + "\\n")
if sys.argv[1:2] == ["freeze"]:
    print(os.environ.get("FAKE_PIP_FREEZE", ""), end="")
sys.exit(int(os.environ.get("FAKE_CMD_EXIT", "0")))
"""


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case: FROM, RUN, ARG, ...
    args: str  # continuation lines joined, comment lines dropped


@dataclass
class Stage:
    name: str
    base: str  # image or earlier stage name, as written after FROM
    instructions: list[Instruction] = field(default_factory=list)

    def find(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


@dataclass(frozen=True)
class Dockerfile:
    path: Path
    header: str  # the leading comment block, '#' stripped
    global_args: list[str]  # ARGs before the first FROM
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def chain(self, name: str) -> list[Stage]:
        """The stage and the stages it is built FROM, base first."""
        names = {s.name for s in self.stages}
        chain = [self.stage(name)]
        while chain[0].base in names:
            chain.insert(0, self.stage(chain[0].base))
        return chain

    def chain_find(self, name: str, keyword: str) -> list[str]:
        return [args for s in self.chain(name) for args in s.find(keyword)]


def parse_dockerfile(path: Path) -> Dockerfile:
    lines = path.read_text().splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line[1:])
    instructions, pending = [], ""
    for line in lines:
        if line.lstrip().startswith("#") or not line.strip():
            continue  # NOTE: Docker drops comment and blank lines even inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]  # Docker drops the backslash and the newline
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip()))
    global_args, stages = [], []
    for inst in instructions:
        if inst.keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", inst.args, re.IGNORECASE)
            assert match, f"{path}: every stage is named: FROM {inst.args}"
            stages.append(Stage(name=match[2], base=match[1]))
        elif stages:
            stages[-1].instructions.append(inst)
        elif inst.keyword == "ARG":
            global_args.append(inst.args)
    return Dockerfile(path, "\n".join(header), global_args, stages)


@pytest.fixture(scope="session")
def cpu_dockerfile() -> Dockerfile:
    return parse_dockerfile(REPO_ROOT / "docker" / "Dockerfile.cpu")


@pytest.fixture(scope="session")
def zen_dockerfile() -> Dockerfile:
    return parse_dockerfile(REPO_ROOT / "docker" / "Dockerfile.zen")


@pytest.fixture(scope="session")
def dockerfiles(cpu_dockerfile: Dockerfile, zen_dockerfile: Dockerfile) -> dict[str, Dockerfile]:
    return {"cpu": cpu_dockerfile, "zen": zen_dockerfile}


@dataclass(frozen=True)
class FakeCommands:
    """A bin directory, first on PATH, whose `docker` and `pip` record each invocation."""

    bin_dir: Path
    log: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "ZENTORCH_VERSION"}
        env.update(PATH=f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}", FAKE_CMD_LOG=str(self.log))
        env.update(extra)
        return env

    def run(self, argv: list[str], cwd: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
        env = self.env(**extra_env)
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)

    def invocations(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def fake_commands(tmp_path: Path) -> FakeCommands:
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name in ("docker", "pip"):
        script = bin_dir / name
        script.write_text(f"#!{sys.executable}\n{_RECORDER}")
        script.chmod(0o755)
    return FakeCommands(bin_dir, tmp_path / "invocations.jsonl")
