"""The docs' image recipes run as written: docs/containers.md's "no registry" block, read from the page and
run in bash from the repository root (Podman; `pytest -m containers`), and every `bash images/build.sh ...`
line the docs show uses only options build.sh accepts (its --dry-run, no engine needed)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from .conftest import REPO

BUILD = "bash images/build.sh"
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "images" / "README.md", REPO / "manifests" / "README.md"]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced code block of a Markdown page, in order."""
    blocks, language, lines = [], None, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if language is None:
                language, lines = line.lstrip()[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines)))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def commands(block: str) -> list[str]:
    """A shell block's command lines, continuations joined."""
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def build_lines() -> list[tuple[str, str]]:
    """(page, command) for each `bash images/build.sh ...` the docs show, in code blocks and inline code."""
    found = []
    for page in PAGES:
        text = page.read_text()
        lines = [line for _, body in code_blocks(text) for line in commands(body)]
        lines += re.findall(rf"`({re.escape(BUILD)}[^`]*)`", text)
        found += [(str(page.relative_to(REPO)), line) for line in lines if line.startswith(BUILD)]
    return found


def no_registry_recipe() -> str:
    """docs/containers.md's shell block that builds on a base made from Debian packages."""
    blocks = [
        body
        for language, body in code_blocks((REPO / "docs" / "containers.md").read_text())
        if language in ("sh", "bash") and f"{BUILD} --debian-base" in body
    ]
    assert len(blocks) == 1, f"docs/containers.md shows {len(blocks)} blocks with {BUILD} --debian-base"
    return blocks[0]


def without_comment(line: str) -> str:
    return re.sub(r"\s+#.*$", "", line)


@pytest.mark.parametrize("page,line", build_lines(), ids=lambda value: value)
def test_documented_build_lines_parse(page: str, line: str):
    """Each documented build line is accepted by build.sh (a dry run prints the engine's commands)."""
    dry = subprocess.run(
        f"{without_comment(line)} --dry-run", shell=True, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, f"{page}: {line}\n{dry.stderr}"
    assert " build -f images/" in dry.stdout, dry.stdout


def test_the_docs_show_build_lines_and_the_recipe():
    assert len(build_lines()) >= 5
    assert any(line.startswith(BUILD) for line in commands(no_registry_recipe()))


def dry_run(*args: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", "images/build.sh", *args, "--dry-run", "step"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_build_trusts_the_ca_bundle_pip_trusts(tmp_path: Path):
    """PIP_CERT's bundle is mounted over the image's (with Podman, or where no engine is installed); the first
    line names it; --no-host-ca keeps the image's own."""
    bundle = tmp_path / "proxy-ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    shown = dry_run(PIP_CERT=str(bundle))
    if "docker build" in shown:
        pytest.skip("Docker cannot mount a CA bundle into a build")
    assert shown.splitlines()[0].startswith(f"build: trusting this machine's CA bundle {bundle} (from PIP_CERT)")
    assert f"--volume {bundle}:/etc/ssl/certs/ca-certificates.crt:ro" in shown
    opted_out = dry_run("--no-host-ca", PIP_CERT=str(bundle))
    assert opted_out.splitlines()[0] == "build: trusting the base image's own CA certificates (--no-host-ca)"
    assert "/etc/ssl/certs" not in opted_out


@pytest.mark.parametrize(
    "log,says",
    [
        ("SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] ...'))", "could not verify TLS"),
        ("Failed to establish a new connection: [Errno -3] Temporary failure in name resolution", "has no network"),
        ("ERROR: No matching distribution found for setuptools>=68", "could not get a package from the index"),
    ],
)
def test_a_build_that_cannot_reach_the_index_names_the_fix(tmp_path: Path, log: str, says: str):
    """A build whose log shows pip could not reach its index ends with what happened and what to do (an
    engine that fails every build with that log stands in for Podman)."""
    (tmp_path / "podman").write_text(f"#!/bin/sh\necho {shlex.quote(log)}\nexit 1\n")
    (tmp_path / "podman").chmod(0o755)
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "BUILD_LOG_DIR": str(tmp_path)}
    fixes = [(("--base", "my/python"), "PIP_CERT"), ((), "--debian-base"), (("--no-host-ca",), "without --no-host-ca")]
    for args, fix in fixes:
        failed = subprocess.run(
            ["bash", "images/build.sh", *args, "step"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "PIP_CERT": str(bundle)},
        )
        last = failed.stderr.strip().splitlines()[-1]
        assert failed.returncode == 1 and says in last, failed.stderr
        if says == "could not verify TLS":
            assert fix in last, last
        else:
            assert "--wheels DIR" in last, last


@pytest.mark.containers
def test_the_no_registry_recipe_builds_the_step_image(tmp_path: Path):
    """docs/containers.md's "no registry" block, as a user types it, building the step image only (` step`
    appended to its build line). Where its wheel directory is not on this machine, an empty one stands in:
    the step image installs no torch."""
    script = []
    for line in commands(no_registry_recipe()):
        if line.startswith(BUILD):
            line = without_comment(line) + " step"
            wheels = re.search(r"--wheels (\S+)", line)
            if wheels and not Path(wheels.group(1)).is_dir():
                line = line.replace(wheels.group(0), f"--wheels {tmp_path}")
        script.append(line)
    env = {key: value for key, value in os.environ.items() if key != "CONTAINERS_CONF"}  # the recipe exports it
    env["BUILD_LOG_DIR"] = str(tmp_path)
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert ran.returncode == 0, "\n".join(script) + f"\nfailed:\n{ran.stdout}\n{ran.stderr}"
    assert "build: trusting " in ran.stdout and f"ghcr.io/rlpipe/step:{VERSION}" in ran.stdout, ran.stdout
    inspect = subprocess.run(
        ["podman", "image", "inspect", f"ghcr.io/rlpipe/step:{VERSION}"],
        capture_output=True,
        text=True,
        env={**env, "CONTAINERS_CONF": str(REPO / "images" / "containers.conf")},
    )
    assert inspect.returncode == 0, inspect.stderr


def rlpipe_lines() -> list[tuple[str, list[str]]]:
    """(page, argv after `rlpipe`) of each `rlpipe ...` command the docs' and README's shell blocks show (in a
    transcript, the `$ ` lines; each command of an `&&` chain)."""
    found = []
    for page in [*PAGES, REPO / "README.md"]:
        for language, body in code_blocks(page.read_text()):
            if language not in ("", "sh", "bash", "console"):
                continue
            lines = commands(body)
            if any(line.startswith("$ ") for line in lines):  # a transcript: the rest is what the command printed
                lines = [line[2:] for line in lines if line.startswith("$ ")]
            for line in lines:
                for part in line.split("&&"):
                    if re.match(r"\s*(\.venv/bin/)?rlpipe \w", part):
                        found.append((str(page.relative_to(REPO)), shlex.split(part, comments=True)[1:]))
    return found


@pytest.mark.parametrize(
    "page,argv", rlpipe_lines(), ids=lambda value: " ".join(value) if isinstance(value, list) else value
)
def test_documented_rlpipe_commands_parse_and_their_specs_load(page: str, argv: list[str]):
    """Each `rlpipe` command the docs show is one the CLI accepts, and a spec it names from this repository
    loads with its `--set`s (what `rlpipe run` reads before its pre-flight); a user's own file (bad.yaml,
    qwen-1.5b.yaml) is only parsed."""
    from rlpipe.pipelines.cli import build_parser
    from rlpipe.pipelines.commands.arguments import overrides
    from rlpipe.spec import load_spec

    args = build_parser().parse_args(argv)  # argparse exits (SystemExit) on what it does not accept
    spec = getattr(args, "spec", None)
    if spec is not None and (REPO / spec).is_file():
        load_spec(REPO / spec, overrides(args))


def test_the_docs_show_rlpipe_commands():
    commands_shown = {argv[0] for _, argv in rlpipe_lines()}
    assert {"run", "compile", "rehearse", "submit", "schedule", "status"} <= commands_shown, commands_shown
