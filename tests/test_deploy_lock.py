"""deploy/docker: the images' locked dependencies, their SBOM and base images (deploy/docker/lock.py).

Offline: each lock covers exactly what requirements.py emits for its image (every name, pinned with == within
the requirement, with sha256 hashes, nothing unpinned), grpcio stays below 1.83, a change to pyproject's
dependencies, a version ARG or the constraints makes `lock.py --check` (and so `make deploy-check`) fail
until `make lock`, the Dockerfiles install from the locks only (with --require-hashes, or --no-index), the
SBOM generator stays out of the runtime image, and a base image without a digest is reported.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from deploy_helpers import DEPLOY, REPO, load
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

lock = load("docker/lock")
req = load("docker/requirements")
DOCKERFILES = {image: DEPLOY / "docker" / f"Dockerfile.{image}" for image in ("cpu", "gpu")}


def _text(name: str) -> str:
    return lock.lock_path(name).read_text(encoding="utf-8")


def _entries(text: str) -> list[str]:
    """A requirements file's logical lines (backslash continuations joined), comments left out."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(" #", 1)[0].strip() for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


# --- the locks ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cpu", "gpu", "build-tools"])
def test_every_lock_entry_is_pinned_and_hashed(name: str) -> None:
    entries = _entries(_text(name))
    assert len(entries) > 20
    for entry in entries:
        requirement, *options = entry.split()
        assert re.fullmatch(r"[a-z0-9][a-z0-9._-]*==[^\s=]+", requirement), entry
        assert options and all(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", o) for o in options), entry


@pytest.mark.parametrize("image", ["cpu", "gpu"])
def test_each_image_lock_covers_exactly_what_requirements_py_emits(image: str) -> None:
    emitted = lock.image_input(image)
    text = _text(image)
    assert lock.recorded(text) == [f"# input: {r}" for r in emitted] + [f"# constraint: {c}" for c in
                                                                        lock.constraints()]
    pins = lock.pins(text)
    for line in emitted:
        wanted = Requirement(line)
        name = canonicalize_name(wanted.name)
        assert name in pins, f"{image}: {line} is not in the lock"
        assert wanted.specifier.contains(pins[name], prereleases=True), (line, pins[name])
    args = lock.dockerfile_args(DOCKERFILES[image])
    assert pins["ray"] == args["RAY_VERSION"]
    runtime = "onnxruntime" if image == "cpu" else "onnxruntime-gpu"
    assert pins[runtime] == args["ORT_VERSION" if image == "cpu" else "ORT_GPU_VERSION"]
    assert not ({"onnxruntime", "onnxruntime-gpu"} - {runtime}) & set(pins), "both ONNX Runtime wheels in one image"
    assert "torch" not in pins


def test_the_two_image_locks_differ_only_in_the_onnx_runtime_wheel() -> None:
    cpu, gpu = lock.pins(_text("cpu")), lock.pins(_text("gpu"))
    assert set(cpu.items()) ^ set(gpu.items()) == {("onnxruntime", cpu["onnxruntime"]),
                                                   ("onnxruntime-gpu", gpu["onnxruntime-gpu"])}


def test_grpcio_stays_below_the_releases_with_the_upstream_bugs() -> None:
    """grpc/grpc#43462 and #43421 arrive with grpcio 1.83; Ray 2.60 resolves with an older one."""
    assert "grpcio<1.83" in lock.constraints()
    for image in ("cpu", "gpu"):
        pins = lock.pins(_text(image))
        assert Version(pins["grpcio"]) < Version("1.83") and pins["ray"] == "2.60.0"
        if "grpcio-reflection" in pins:  # released in step with grpcio
            assert Version(pins["grpcio-reflection"]) < Version("1.83")


def test_build_tools_lock_holds_the_build_backend_and_the_sbom_generator() -> None:
    pins = lock.pins(_text("build-tools"))
    assert lock.recorded(_text("build-tools"))[:len(lock.build_tools_input())] == [
        f"# input: {r}" for r in lock.build_tools_input()]
    assert "setuptools" in pins and "cyclonedx-bom" in pins
    assert f"cyclonedx-bom=={pins['cyclonedx-bom']}" in lock.BUILD_TOOLS
    for image in ("cpu", "gpu"):  # neither tool lands in an image's venv
        assert not {"cyclonedx-bom", "cyclonedx-python-lib", "setuptools", "uv"} & set(lock.pins(_text(image)))


def test_the_shipped_locks_are_current() -> None:
    assert lock.stale_locks() == [] and lock.main(["--check"]) == 0


# --- a changed input makes the locks stale ------------------------------------------------------------------

@pytest.fixture()
def sources(tmp_path: Path, monkeypatch) -> Path:
    """A copy of pyproject.toml and deploy/docker that lock.py reads instead of the repository's."""
    docker = tmp_path / "deploy" / "docker"
    shutil.copytree(DEPLOY / "docker", docker)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    monkeypatch.setattr(lock, "DOCKER", docker)
    monkeypatch.setattr(lock, "REPO", tmp_path)
    monkeypatch.setattr(lock, "PYPROJECT", tmp_path / "pyproject.toml")
    monkeypatch.setattr(lock, "CONSTRAINTS", docker / "constraints.txt")
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


STALE = [
    ("a package added to the serve extra", "pyproject.toml", '    "httpx>=0.27",\n]\n# `kvserve import',
     '    "httpx>=0.27",\n    "uvloop>=0.19",\n]\n# `kvserve import', {"cpu", "gpu"}),
    ("a base dependency raised", "pyproject.toml", '"pydantic>=2.6"', '"pydantic>=2.9"', {"cpu", "gpu"}),
    ("a base dependency dropped", "pyproject.toml", '    "tqdm>=4.66",\n', "", {"cpu", "gpu"}),
    ("the Ray ARG bumped", "deploy/docker/Dockerfile.cpu", "ARG RAY_VERSION=2.60.0", "ARG RAY_VERSION=2.61.0",
     {"cpu"}),
    ("the GPU runtime ARG bumped", "deploy/docker/Dockerfile.gpu", "ARG ORT_GPU_VERSION=1.31.1",
     "ARG ORT_GPU_VERSION=1.32.0", {"gpu"}),
    ("the constraint lifted", "deploy/docker/constraints.txt", "grpcio<1.83", "grpcio<1.90",
     {"cpu", "gpu", "build-tools"}),
    ("the build backend raised", "pyproject.toml", 'requires = ["setuptools>=68"]', 'requires = ["setuptools>=70"]',
     {"build-tools"}),
]


@pytest.mark.parametrize("where,old,new,stale", [c[1:] for c in STALE], ids=[c[0] for c in STALE])
def test_a_changed_input_makes_its_locks_stale(sources: Path, where: str, old: str, new: str, stale: set) -> None:
    assert lock.stale_locks() == []
    _edit(sources / where, old, new)
    assert {p.name for p in lock.stale_locks()} == {lock.lock_path(n).name for n in stale}
    assert lock.main(["--check"]) == 1


# --- the Dockerfiles ----------------------------------------------------------------------------------------

def _stage(text: str, name: str) -> str:
    return text.split(f" AS {name}\n", 1)[1].split("\nFROM ", 1)[0]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_image_installs_from_its_lock_only(image: str) -> None:
    text = DOCKERFILES[image].read_text()
    build = re.sub(r"\\\n\s*", " ", _stage(text, "build"))
    assert f"pip install --no-cache-dir --require-hashes --no-deps -r /src/requirements.{image}.lock" in build
    assert f"deploy/docker/requirements.{image}.lock /src/" in build
    installs = re.findall(r"pip install [^&\n]*", build)
    assert len(installs) == 4, installs  # the lock, the ARG check, the build tools, the package's wheel
    for command in installs:  # every install is hashed, or may not reach an index at all
        assert "--require-hashes" in command or "--no-index" in command, command
        assert "--no-deps" in command, command
    wheel = re.search(r"pip wheel [^&\n]*", build).group(0)
    assert "--no-build-isolation" in wheel and "--no-deps" in wheel  # the backend is the locked one
    tools = "/opt/build-tools/bin/pip install --no-cache-dir --require-hashes --no-deps -r /src/build-tools.lock"
    assert tools in build


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_sbom_describes_the_runtime_venv_and_its_generator_stays_behind(image: str) -> None:
    text = DOCKERFILES[image].read_text()
    build = re.sub(r"\\\n\s*", " ", _stage(text, "build"))
    command = re.search(r"cyclonedx-py environment [^&\n]*", build).group(0).split()
    assert command[-1] == "/opt/venv" and "--output-reproducible" in command
    assert command[command.index("-o") + 1] == "/usr/share/kvserve/sbom.cdx.json"
    assert build.index("cyclonedx-py") > build.index("pip check")  # after the package itself is installed
    copies = re.findall(r"^COPY --from=build (\S+) (\S+)$", _stage(text, "runtime"), re.M)
    assert copies == [("/opt/venv", "/opt/venv"),
                      ("/usr/share/kvserve/sbom.cdx.json", "/usr/share/kvserve/sbom.cdx.json")]


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_base_image_takes_its_digest_argument(image: str) -> None:
    image_arg, digest_arg = lock.BASE_IMAGE_ARGS[DOCKERFILES[image].name]
    text = DOCKERFILES[image].read_text()
    assert re.search(rf"^FROM \${{{image_arg}}}\${{{digest_arg}}} AS base$", text, re.M)
    digest = lock.dockerfile_args(DOCKERFILES[image])[digest_arg]
    assert digest == "" or lock.DIGEST.fullmatch(digest), digest


@pytest.mark.parametrize("digest,reported", [
    ("", True), ("@sha256:" + "0" * 64, False), ("sha256:" + "0" * 64, True), ("@sha256:abc", True)])
def test_a_base_image_without_a_digest_is_reported(sources: Path, digest: str, reported: bool) -> None:
    for name, arg, value in (("Dockerfile.cpu", "PYTHON_DIGEST", digest),
                             ("Dockerfile.gpu", "CUDA_DIGEST", "@sha256:" + "1" * 64)):
        path = sources / "deploy" / "docker" / name
        text, found = re.subn(rf"^ARG {arg}=.*$", f"ARG {arg}={value}", path.read_text(), flags=re.M)
        assert found == 1
        path.write_text(text)
    found = lock.unpinned_base_images()
    assert [w.split(":", 1)[0] for w in found] == (["Dockerfile.cpu"] if reported else [])
