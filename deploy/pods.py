"""The Ray containers' settings that keep kvserve safe, checked offline (deploy/validate.py `check_rayservice`).

- The API key reaches the replicas only through the environment, from a Kubernetes Secret
  (`valueFrom.secretKeyRef`, `optional: false`: a pod without the Secret does not start), under the name
  serveConfigV2's `args.api_key_env` gives.
- Ray's Serve proxy runs kvserve's header guard (serving/server/proxy_guard.py) on every Ray container.
- Deleting a worker pod (kubectl delete, node drain, NewCluster upgrade) lets its requests finish:
  Kubernetes runs the preStop hook, then sends SIGTERM, on which `ray start --block` marks its node
  draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S and waits until the node is idle. Meanwhile Serve
  starts replacement replicas on other nodes, stops the node's replicas gracefully (each waits up to its
  deployment's graceful_shutdown_timeout_s for its requests; Serve stops it at the latest that long before
  the drain deadline) and drains the node's proxy (503 on its health check, in-flight requests finish). The
  numbers must nest: request deadline <= graceful_shutdown_timeout_s; graceful_shutdown_timeout_s + time
  for a replacement <= drain; preStop + drain + Ray's teardown <= terminationGracePeriodSeconds.
- Least privilege: no pod mounts the ServiceAccount token automatically (`automountServiceAccountToken: false`),
  and no Ray container mounts a token volume of its own; only KubeRay's autoscaler container may (through
  `autoscalerOptions.volumeMounts`). Every container's root filesystem is read-only, with a writable volume at
  /tmp, where Ray keeps its session directory (/tmp/ray).

Not here: network exposure (deploy/exposure.py), schemas and the rest of the KubeRay facts (validate.py).
"""
from __future__ import annotations

from typing import Any

Doc = dict[str, Any]
KVSERVE_IMPORT_PATH = "serving.server.app:build_app"
# `ray start --block` drains its node on SIGTERM for this many seconds (Ray 2.60: default 30, 0 = off).
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
MIGRATION_MARGIN_S = 20  # for a replacement replica to start (load and warm a bundle) before the old one stops
TEARDOWN_MARGIN_S = 10   # Ray stops its processes after the drain: 1 s each, then SIGKILL
RAY_TMP = "/tmp"  # Ray's session directory is /tmp/ray: logs, sockets, spilled objects


def _containers(group: Doc) -> list[Doc]:
    return group["template"]["spec"]["containers"]


def _env(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env") or []}


def env_errors(serve: Doc, groups: list[Doc]) -> list[str]:
    """The proxy's header guard on every Ray container; the API key from a Secret wherever replicas run."""
    from serving.server.proxy_guard import CALLBACK_ENV, PROXY_CALLBACK

    key_envs = {(a.get("args") or {}).get("api_key_env") for a in serve["applications"]
                if a.get("import_path") == KVSERVE_IMPORT_PATH} - {None}
    errors = []
    for group in groups:
        name = group.get("groupName", "head")
        for c in _containers(group):
            env = _env(c)
            if env.get(CALLBACK_ENV, {}).get("value") != PROXY_CALLBACK:
                errors.append(f"group {name}: container {c['name']} needs env {CALLBACK_ENV}={PROXY_CALLBACK}: "
                              f"without it Ray's proxy answers a non-UTF-8 x-request-id with a bare 500")
            for key_env in sorted(key_envs) if "groupName" in group else []:
                ref = (env.get(key_env) or {}).get("valueFrom", {}).get("secretKeyRef") or {}
                if not ref.get("name") or ref.get("optional") is not False or "value" in env.get(key_env, {}):
                    errors.append(f"group {name}: container {c['name']} must take {key_env} (serveConfigV2's "
                                  f"api_key_env) from a Secret: env valueFrom.secretKeyRef with optional: false")
    return errors


def graceful_errors(serve: Doc, group: Doc) -> list[str]:
    """Deleting a worker pod lets its requests finish: preStop, then Ray's drain on SIGTERM, within the grace.

    On SIGTERM `ray start` marks its node draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: Serve starts
    replacements elsewhere and stops the node's replicas gracefully, at the latest graceful_shutdown_timeout_s
    before the drain deadline, so the drain must outlast the longest graceful stop (plus time for a replacement
    to start), and the grace period the preStop plus the drain plus Ray's own teardown."""
    from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S

    from serving.server.config import Limits

    name, errors = group["groupName"], []
    graceful = 0.0
    for app in serve["applications"]:
        limits = Limits.model_validate((app.get("args") or {}).get("limits") or {})
        for dep in app.get("deployments") or []:
            stop_s = dep.get("graceful_shutdown_timeout_s", DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S)
            graceful = max(graceful, stop_s)
            if app.get("import_path") == KVSERVE_IMPORT_PATH and stop_s < limits.request_timeout_s:
                errors.append(f"deployment {dep['name']!r}: graceful_shutdown_timeout_s={stop_s} < the request "
                              f"deadline {limits.request_timeout_s} s: a replica stopping for a pod deletion cuts "
                              f"requests still allowed to run")
    container = _containers(group)[0]
    pre_stop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command") or []
    if not pre_stop:
        errors.append(f"group {name}: container {container['name']} has no lifecycle.preStop: Service endpoints "
                      f"and ingress controllers may still send new connections when Ray starts draining")
    pre_stop_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] and len(pre_stop) == 2 else 0.0
    drain = _env(container).get(DRAIN_ENV, {}).get("value")
    drain_s = float(drain) if drain else 0.0
    if drain_s < graceful + MIGRATION_MARGIN_S:
        errors.append(f"group {name}: {DRAIN_ENV}={drain or 'unset'} must be at least the longest "
                      f"graceful_shutdown_timeout_s ({graceful:g}) + {MIGRATION_MARGIN_S} s for a replacement "
                      f"replica to start")
    grace = group["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    if grace < pre_stop_s + drain_s + TEARDOWN_MARGIN_S:
        errors.append(f"group {name}: terminationGracePeriodSeconds={grace} < preStop {pre_stop_s:g} s + drain "
                      f"{drain_s:g} s + {TEARDOWN_MARGIN_S} s teardown: Kubernetes would kill the pod mid-drain")
    return errors


def privilege_errors(cluster: Doc) -> list[str]:
    """No ServiceAccount token in the Ray containers, read-only root filesystems with a writable /tmp: in the
    head, every worker group and KubeRay's autoscaler (`cluster` is a RayService's rayClusterConfig)."""
    errors = []
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    for group in groups:
        name, spec = group.get("groupName", "head"), group["template"]["spec"]
        automount = spec.get("automountServiceAccountToken")
        if automount is not False:
            shown = "unset" if automount is None else automount
            errors.append(f"group {name}: automountServiceAccountToken is {shown}: Kubernetes mounts the ServiceAccount "
                          f"token into every container, and code running in a replica could call the Kubernetes API "
                          f"with it; set it to false")
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        tokens = {n for n, v in volumes.items()
                  if any("serviceAccountToken" in s for s in (v.get("projected") or {}).get("sources") or [])}
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            where = f"group {name}: container {c['name']}"
            errors += _filesystem_errors(where, c.get("securityContext"), c.get("volumeMounts") or [], volumes)
            errors += [f"{where} mounts the ServiceAccount token volume {m['name']}: only the autoscaler "
                       f"(autoscalerOptions.volumeMounts) needs the Kubernetes API"
                       for m in c.get("volumeMounts") or [] if m["name"] in tokens]
    if cluster.get("enableInTreeAutoscaling"):
        options = cluster.get("autoscalerOptions") or {}
        head_volumes = {v["name"]: v for v in cluster["headGroupSpec"]["template"]["spec"].get("volumes") or []}
        errors += _filesystem_errors("autoscalerOptions (the autoscaler container)", options.get("securityContext"),
                                     options.get("volumeMounts") or [], head_volumes)
    return errors


def _filesystem_errors(where: str, security: Doc | None, mounts: list[Doc], volumes: dict[str, Doc]) -> list[str]:
    errors = [f"{where}: volumeMount {m['name']} names no volume of the pod: the pod would not start"
              for m in mounts if m["name"] not in volumes]
    if (security or {}).get("readOnlyRootFilesystem") is not True:
        errors.append(f"{where}: securityContext.readOnlyRootFilesystem must be true: code running there could "
                      f"rewrite the image's programs and libraries; mount an emptyDir where it writes ({RAY_TMP})")
    elif not any(m["mountPath"] == RAY_TMP and not m.get("readOnly") and m["name"] in volumes for m in mounts):
        errors.append(f"{where}: the root filesystem is read-only but nothing writable is mounted at {RAY_TMP}: "
                      f"Ray writes its session directory (/tmp/ray) there; mount an emptyDir")
    return errors
