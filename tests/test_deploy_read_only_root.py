"""The Ray pods' read-only root filesystem, on a real Ray and kvserve (slow; the cluster suite CI runs).

What a worker pod runs, in a mount, network and PID namespace of its own (`unshare -rmnpf`: no privileges needed
where the kernel allows user namespaces; skipped elsewhere): the root filesystem read-only, writable only where
the rendered worker pod mounts emptyDirs (/tmp, the home directory) and /dev/shm (KubeRay adds it), the worker
container's environment from the manifest, then `ray start` and what the KubeRay operator does, `serve deploy`
of the image's Serve config through the dashboard, on tiny bundles. The application must become ready and
translate, and no Ray log may report a write refused by the read-only filesystem.
"""
from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_helpers import DEPLOY, by_kind, rendered_lite

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

IMAGE_HOME = "/home/kvserve"  # the image user's home (Dockerfile: useradd --create-home, WORKDIR)

INSIDE = r"""
set -u
ip link set lo up
mount --bind "$WORK" "$MNT" && mount -o remount,bind,ro "$MNT"
mount -o remount,bind,ro /
mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs "$HOME" && mount -t tmpfs tmpfs /dev/shm
cd "$HOME"
if touch /kvserve-probe 2>/dev/null || touch "$MNT/probe" 2>/dev/null; then echo "root is writable"; exit 3; fi
ray start --head --num-cpus 2 --dashboard-host 0.0.0.0 --disable-usage-stats > /tmp/start.log 2>&1 \
    || { cat /tmp/start.log; exit 4; }
serve deploy "$MNT/serve_config.yaml" --address http://127.0.0.1:8265 > /tmp/deploy.log 2>&1 \
    || { cat /tmp/deploy.log; ray stop --force > /dev/null 2>&1; exit 5; }
python - <<'EOF'
import json, os, time, urllib.error, urllib.request
def get(path, body=None):
    req = urllib.request.Request("http://127.0.0.1:8000" + path, data=body, headers={
        "Authorization": "Bearer " + os.environ["KVSERVE_API_KEY"], "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
ready, why, deadline = None, "", time.monotonic() + 240
while ready != 200 and time.monotonic() < deadline:  # 404 until Serve has deployed the application
    try:
        ready, why = get("/v2/health/ready")
    except OSError:  # nothing listens yet
        ready = None
    if ready != 200:
        time.sleep(2)
body = json.dumps({"text": "Good morning.", "max_tokens": 8}).encode()  # tiny bundles: 64 positions
status, text = get("/v1/translate", body) if ready == 200 else (None, why)
# The whole answer: a cut one is not JSON. An error body is cut to keep the assertion message short.
print("RESULT " + json.dumps({"ready": ready, "status": status, "body": text if status == 200 else text[:2000]}))
EOF
grep -rl "Read-only file system" /tmp/ray/session_latest/logs 2>/dev/null | sed 's/^/READ-ONLY-ERROR /'
ray stop --force > /dev/null 2>&1
exit 0
"""


def _namespaces_allowed() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "-rmnpf", "--mount-proc", "sh", "-c",
                            "mount -t tmpfs tmpfs /mnt 2>/dev/null || mount -t tmpfs tmpfs /srv"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def _worker_container() -> dict:
    cluster = by_kind(rendered_lite("cpu"), "RayService")[0]["spec"]["rayClusterConfig"]
    return cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _image_config(bundles: Path, local: Path) -> dict:
    """The image's Serve config on the tiny bundles at `bundles` (their copy here: `local`), each pinned by its
    own content hash as the image pins the published ones."""
    from export.bundle import content_sha256, load_bundle

    cfg = yaml.safe_load((DEPLOY / "docker" / "serve_config.cpu.yaml").read_text())
    app = cfg["applications"][0]
    app["args"]["artifacts_dir"] = str(bundles)
    for model in app["args"]["models"]:
        assert model["bundle_sha256"], model  # the image pins what it serves
        model["bundle_sha256"] = content_sha256(load_bundle(local / model["bundle"]).manifest)
    for dep in app["deployments"]:
        dep["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    return cfg


def test_a_worker_pod_serves_with_a_read_only_root_filesystem(bundles: Path, tmp_path: Path) -> None:
    if not _namespaces_allowed():
        pytest.skip("no unprivileged user namespaces (unshare -rmnpf) on this machine")
    if any(Path(p).resolve().is_relative_to("/tmp") for p in (sys.prefix, DEPLOY)):
        pytest.skip("the venv or the checkout lies under /tmp, which the pod's emptyDir hides")
    container = _worker_container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp", IMAGE_HOME}
    mnt = next(Path(p) for p in ("/srv", "/mnt") if Path(p).is_dir())
    work = tmp_path / "work"
    (work / "home").mkdir(parents=True)
    shutil.copytree(bundles / "bundles", work / "bundles")
    (work / "bin").mkdir(mode=0o700)
    from serving.server.haproxy import haproxy_wrapper  # what the image writes into /opt/kvserve-haproxy

    wrapper = haproxy_wrapper(work / "bin")
    assert wrapper is not None and wrapper.parent == work / "bin"
    (work / "serve_config.yaml").write_text(yaml.safe_dump(_image_config(mnt / "bundles", work / "bundles"),
                                                                 sort_keys=False))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin", HOME=str(mnt / "home"),
               WORK=str(work), MNT=str(mnt), RAY_SERVE_HAPROXY_BINARY_PATH=str(mnt / "bin" / wrapper.name),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), KVSERVE_API_KEY=secrets.token_hex(16))
    # A PID namespace of its own too: `ray stop --force` in there must not stop the test run's own Ray cluster.
    done = subprocess.run(["unshare", "-rmnpf", "--mount-proc", "bash", "-c", INSIDE], env=env, capture_output=True,
                          text=True, timeout=540)
    out = done.stdout + done.stderr
    result = next((json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert done.returncode == 0 and result, out[-4000:]
    assert result["ready"] == 200 and result["status"] == 200, result
    assert json.loads(result["body"])["translations"], result
    assert "READ-ONLY-ERROR" not in done.stdout, out[-4000:]
