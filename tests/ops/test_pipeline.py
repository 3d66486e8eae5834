"""ops/pipeline.yml (Buildkite): step dependencies, queues, retry rules, no source-file filter."""

from __future__ import annotations

import os
import shlex
import string
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_QUEUE = "cpu_queue"
AGENT_LOST_RETRY = [{"exit_status": -1, "limit": 2}, {"exit_status": -10, "limit": 2}]
# Keys with which a Buildkite step (or vLLM's pipeline generator) runs only when some files changed.
SOURCE_FILTER_KEYS = {"if_changed", "source_file_dependencies"}


@pytest.fixture(scope="module")
def pipeline() -> dict:
    return yaml.safe_load((REPO_ROOT / "ops" / "pipeline.yml").read_text())


@pytest.fixture(scope="module")
def steps(pipeline) -> dict[str, dict]:
    steps = {step["key"]: step for step in pipeline["steps"]}
    assert len(steps) == len(pipeline["steps"]), "step keys are unique"
    return steps


def _command_argvs(step: dict, env: dict[str, str]) -> list[list[str]]:
    """Each command as the job's shell would run it: `$$` is Buildkite's escape for a runtime `$`."""
    return [
        [string.Template(word).substitute(env) for word in shlex.split(command.replace("$$", "$"))]
        for command in step["commands"]
    ]


@pytest.fixture(scope="module")
def job_env(pipeline) -> dict[str, str]:
    return {**pipeline["env"], "BUILDKITE_COMMIT": "abc123"}


def test_zen_image_step_depends_on_the_cpu_image_step(steps):
    assert steps["image-build-zen-cpu"]["depends_on"] == ["image-build-cpu"]


def test_test_step_depends_on_the_cpu_image_step(steps):
    assert steps["test-cpu"]["depends_on"] == ["image-build-cpu"]


def test_every_step_runs_on_the_cpu_queue(steps):
    assert {key: step["agents"] for key, step in steps.items()} == {key: {"queue": CPU_QUEUE} for key in steps}


def test_no_step_has_a_source_file_filter(steps):
    for key, step in steps.items():
        assert not SOURCE_FILTER_KEYS & step.keys(), key
        assert "if" not in step, key  # a conditional could skip the step as well


def test_every_step_retries_twice_when_the_agent_is_lost(steps):
    for key, step in steps.items():
        assert step["retry"] == {"automatic": AGENT_LOST_RETRY}, key


def test_build_steps_run_the_build_scripts_with_registry_repo_and_commit(steps, job_env):
    assert _command_argvs(steps["image-build-cpu"], job_env) == [
        ["ops/image_build_cpu.sh", "localhost", "zenserve", "abc123"]
    ]
    assert _command_argvs(steps["image-build-zen-cpu"], job_env) == [
        ["ops/image_build_zen_cpu.sh", "localhost", "zenserve", "abc123"]
    ]
    for script in ("image_build_cpu.sh", "image_build_zen_cpu.sh"):
        assert os.access(REPO_ROOT / "ops" / script, os.X_OK)


def test_test_step_runs_the_suite_offline_in_the_image_the_cpu_script_builds(
    steps, job_env, fake_commands, tmp_path
):
    build, run = _command_argvs(steps["test-cpu"], job_env)
    assert build == ["ops/image_build_cpu.sh", "localhost", "zenserve", "abc123"]

    fake_commands.run([str(REPO_ROOT / build[0]), *build[1:]], cwd=tmp_path)
    built = {
        argv[argv.index("--target") + 1]: argv[argv.index("--tag") + 1]
        for argv in (i["argv"] for i in fake_commands.invocations())
    }
    assert run[:5] == ["docker", "run", "--rm", "--network", "none"]
    assert run[5] == built["zenserve-test"]
    assert run[6:] == ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"]
