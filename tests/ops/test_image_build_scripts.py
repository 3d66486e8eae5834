"""ops/image_build_*.sh run against a fake `docker` that records each invocation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_SCRIPT = REPO_ROOT / "ops" / "image_build_cpu.sh"
ZEN_SCRIPT = REPO_ROOT / "ops" / "image_build_zen_cpu.sh"
ARGS = ["registry.example", "zenserve", "abc123"]
IMAGE = "registry.example/zenserve:abc123"


@dataclass(frozen=True)
class Build:
    file: str
    platform: str
    target: str
    tag: str
    build_args: dict[str, str]
    context: str


def _parse_build(argv: list[str]) -> Build:
    """`docker build` argv → its options; fails on any option the scripts are not expected to pass."""
    assert argv[0] == "build", argv
    options: dict[str, str] = {}
    build_args: dict[str, str] = {}
    positional = []
    rest = iter(argv[1:])
    for arg in rest:
        if arg == "--build-arg":
            key, _, value = next(rest).partition("=")
            assert key not in build_args, f"{key} passed twice"
            build_args[key] = value
        elif arg in ("--file", "--platform", "--target", "--tag", "--progress"):
            assert arg not in options, f"{arg} passed twice"
            options[arg] = next(rest)
        else:
            assert not arg.startswith("-"), f"unexpected option {arg}"
            positional.append(arg)
    assert len(positional) == 1, positional
    return Build(
        file=options["--file"],
        platform=options["--platform"],
        target=options["--target"],
        tag=options["--tag"],
        build_args=build_args,
        context=positional[0],
    )


def _builds(fake_commands) -> list[Build]:
    invocations = fake_commands.invocations()
    # The build context "." must be the repository root, wherever the script was started from.
    assert all(Path(i["cwd"]) == REPO_ROOT for i in invocations)
    return [_parse_build(i["argv"]) for i in invocations]


@pytest.mark.parametrize("script", [CPU_SCRIPT, ZEN_SCRIPT], ids=lambda p: p.name)
@pytest.mark.parametrize("num_args", [0, 1, 2])
def test_fewer_than_three_args_prints_usage_and_exits_1(fake_commands, tmp_path, script, num_args):
    result = fake_commands.run([str(script), *ARGS[:num_args]], cwd=tmp_path)

    assert result.returncode == 1
    assert "Usage:" in result.stderr and "<registry> <repo> <commit>" in result.stderr
    assert fake_commands.invocations() == []


@pytest.mark.parametrize("script", [CPU_SCRIPT, ZEN_SCRIPT], ids=lambda p: p.name)
def test_script_is_strict_bash(script):
    assert script.stat().st_mode & 0o111, f"{script} is not executable"
    lines = script.read_text().splitlines()
    assert lines[0] in ("#!/usr/bin/env bash", "#!/bin/bash")
    assert "set -euo pipefail" in lines


def test_cpu_script_builds_the_serving_then_the_test_image_tagged_by_commit(fake_commands, tmp_path):
    result = fake_commands.run([str(CPU_SCRIPT), *ARGS], cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert _builds(fake_commands) == [
        Build(
            file="docker/Dockerfile.cpu",
            platform="linux/amd64",
            target="zenserve-openai",
            tag=f"{IMAGE}-cpu",
            build_args={"GIT_COMMIT": "abc123"},
            context=".",
        ),
        Build(
            file="docker/Dockerfile.cpu",
            platform="linux/amd64",
            target="zenserve-test",
            tag=f"{IMAGE}-cpu-test",
            build_args={"GIT_COMMIT": "abc123"},
            context=".",
        ),
    ]


def test_zen_script_builds_the_cpu_base_then_the_zen_test_image_on_it(fake_commands, tmp_path):
    result = fake_commands.run([str(ZEN_SCRIPT), *ARGS], cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert _builds(fake_commands) == [
        Build(
            file="docker/Dockerfile.cpu",
            platform="linux/amd64",
            target="zenserve-openai",
            tag=f"{IMAGE}-cpu",
            build_args={"GIT_COMMIT": "abc123"},
            context=".",
        ),
        Build(
            file="docker/Dockerfile.zen",
            platform="linux/amd64",
            target="zenserve-zen-test",
            tag=f"{IMAGE}-zen-cpu-test",
            build_args={"BASE_IMAGE": f"{IMAGE}-cpu", "GIT_COMMIT": "abc123"},
            context=".",
        ),
    ]


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, None), ({"ZENTORCH_VERSION": ""}, None), ({"ZENTORCH_VERSION": "2.13.0.2"}, "2.13.0.2")],
    ids=["unset", "empty", "set"],
)
def test_zen_script_passes_zentorch_version_only_when_set(fake_commands, tmp_path, env, expected):
    result = fake_commands.run([str(ZEN_SCRIPT), *ARGS], cwd=tmp_path, **env)

    assert result.returncode == 0, result.stderr
    cpu_base, zen = _builds(fake_commands)
    assert "ZENTORCH_VERSION" not in cpu_base.build_args
    assert zen.build_args.get("ZENTORCH_VERSION") == expected


def test_zen_script_stops_when_the_cpu_base_build_fails(fake_commands, tmp_path):
    result = fake_commands.run([str(ZEN_SCRIPT), *ARGS], cwd=tmp_path, FAKE_CMD_EXIT="1")

    assert result.returncode != 0
    assert [b.target for b in _builds(fake_commands)] == ["zenserve-openai"]


@pytest.mark.parametrize("script", [CPU_SCRIPT, ZEN_SCRIPT], ids=lambda p: p.name)
def test_script_never_pushes(fake_commands, tmp_path, script):
    fake_commands.run([str(script), *ARGS], cwd=tmp_path, ZENTORCH_VERSION="2.13.0.2")

    invocations = fake_commands.invocations()
    assert invocations
    for invocation in invocations:
        argv = invocation["argv"]
        assert argv[0] == "build", argv
        assert not {"--push", "--output", "-o", "--load"} & set(argv), argv
