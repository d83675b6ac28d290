"""deploy/: what the shipped manifests and Serve configs expose, and that deploy/validate.py refuses worse.

The repository's overlays pass; each mutation below breaks one rule and must fail with a message naming
it: a Service or Ingress in front of Ray's control ports, the head Service carrying the Ray client port,
Ray token authentication off, the dashboard bound where the KubeRay operator cannot reach it, a missing or
too open NetworkPolicy, a Secret in the manifests, a plaintext API key, an API key not from a Secret, an
unbounded queue, and graceful-deletion settings that do not nest. The NetworkPolicy evaluator itself is
checked on Kubernetes' selector semantics.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from deploy_helpers import (head_group as _head, ray_cluster as _cluster, rendered_copy as _docs,
                            worker_group as _worker, DEPLOY, by_kind, load, rendered_lite)

from serving.server.config import split

val = load("validate")
exposure = load("exposure")
gen = load("gen_rayservice")
kl = load("kustomize_lite")


def _container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def _policy(docs: list[dict]) -> dict:
    return by_kind(docs, "NetworkPolicy")[0]


def _rules(docs: list[dict]) -> list[dict]:
    return _policy(docs)["spec"]["ingress"]


def _service(port: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ray-debug", "namespace": "kvserve"},
            "spec": {"selector": {"ray.io/node-type": "head"}, "ports": [port]}}


def _serve(docs: list[dict], mutate) -> None:
    rayservice = by_kind(docs, "RayService")[0]
    cfg = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    mutate(cfg)
    rayservice["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)


def _app(cfg: dict) -> dict:
    return cfg["applications"][0]


def _split_serve(docs: list[dict], mutate) -> None:
    """serveConfigV2 as generated from deploy/serve_config.yaml in split form (a deployment per model, as
    `--placement split`; serving.server.config.split), then `mutate`d."""
    cfg = gen.load_serve_config()
    split(_app(cfg), ["translate", "generate"])
    # split() hands each model deployment the ingress's own backpressure_config dict (one object, a YAML alias
    # when dumped); a copy, so that breaking one deployment's rule leaves the others' as they are.
    cfg = json.loads(json.dumps(cfg))
    rayservice = by_kind(docs, "RayService")[0]
    rayservice["spec"]["serveConfigV2"] = gen.dump_serve_config(gen.image_serve_config(cfg, gen.Variant.GPU))
    _serve(docs, mutate)


def _dep(cfg: dict, name: str) -> dict:
    return next(d for d in _app(cfg)["deployments"] if d["name"] == name)


def _uncolocate_generate(cfg: dict) -> None:
    """generate no longer colocated (its knobs out of the ingress's user_config), and no deployment entry added."""
    next(m for m in _app(cfg)["args"]["models"] if m["name"] == "generate")["colocated"] = False
    del _dep(cfg, "ingress")["user_config"]["models"]["generate"]


def _env(group: dict, name: str) -> dict:
    return next(e for e in _container(group)["env"] if e["name"] == name)


def _drop_env(group: dict, name: str) -> None:
    _container(group)["env"] = [e for e in _container(group)["env"] if e["name"] != name]


# --- the repository's files ---------------------------------------------------------------------------

def test_the_repository_overlays_pass_the_exposure_rules() -> None:
    for overlay in ("gpu", "cpu", "gpu-volume"):
        docs = _docs(overlay)
        assert exposure.check(docs) == [] and val.validate_docs(docs) == [], overlay


def _shipped_yaml() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and "crds" not in p.parts)


def _mappings(node: object):
    """Every mapping in a YAML tree, descending into strings that hold YAML themselves (serveConfigV2)."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _mappings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _mappings(item)
    elif isinstance(node, str) and "\n" in node and "applications:" in node:
        yield from _mappings(yaml.safe_load(node))


def test_no_shipped_yaml_holds_an_api_key() -> None:
    found = {}
    for path in _shipped_yaml():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            keys = [m["api_key"] for m in _mappings(doc) if m.get("api_key") is not None]
            if keys:
                found[path] = keys
    assert len(_shipped_yaml()) > 10 and found == {}


def test_image_and_cluster_configs_name_the_key_variable_and_never_an_api_key() -> None:
    generated = list(gen.outputs())
    assert len(generated) == 4
    for path in generated:
        apps = [m for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) for m in _mappings(doc)
                if m.get("import_path") == gen.KVSERVE_IMPORT_PATH]
        assert apps, path
        for app in apps:
            assert "api_key" not in app["args"] and app["args"]["api_key_env"] == gen.API_KEY_ENV, path


def _serve_configs() -> list[tuple[str, dict]]:
    configs = [(p.name, yaml.safe_load(p.read_text(encoding="utf-8"))) for p in val.SERVE_CONFIGS]
    configs += [(f"serveConfigV2 ({o})", yaml.safe_load(by_kind(rendered_lite(o), "RayService")[0]["spec"]
                                                         ["serveConfigV2"])) for o in ("gpu", "cpu")]
    return configs


def test_every_shipped_serve_config_bounds_every_queue_with_429() -> None:
    configs = _serve_configs()
    assert len(configs) == 5
    for where, cfg in configs:
        deployments = _app(cfg)["deployments"]
        # Every model runs in the ingress replica: no deployment of its own, so none with Serve's unbounded default.
        models = _app(cfg)["args"]["models"]
        assert {m["name"] for m in models if m.get("colocated")} == {"translate", "generate"}, where
        assert all(m.get("colocated") and not m.get("canary") for m in models), where
        assert {d["name"] for d in deployments} == {"ingress"}, where
        for dep in deployments:
            assert dep["max_queued_requests"] >= 1, (where, dep["name"])
            assert dep["backpressure_config"]["status_code"] == 429, (where, dep["name"])
            assert dep["backpressure_config"]["retry_after_s"] > 0, (where, dep["name"])


def test_the_head_service_kuberay_builds_carries_no_ray_client_port() -> None:
    """KubeRay copies the head container's ports onto the head Service (common/service.go getServicePorts)."""
    for overlay in ("gpu", "cpu", "gpu-volume"):
        ports = {p["name"]: p["containerPort"] for p in _container(_head(_docs(overlay)))["ports"]}
        assert ports == {"gcs-server": 6379, "dashboard": 8265, "serve": 8000, "metrics": 8080}


def test_ray_token_auth_is_on_with_a_named_secret_and_the_pinned_ray_supports_it() -> None:
    import ray
    from ray._private.authentication.authentication_token_setup import AUTH_MODE_ENV_VAR

    cluster = _cluster(_docs())
    assert cluster["authOptions"] == {"mode": "token", "secretName": "kvserve-ray-token"}
    assert cluster["rayVersion"] == ray.__version__ and AUTH_MODE_ENV_VAR == "RAY_AUTH_MODE"


def test_the_pinned_ray_drains_its_node_on_sigterm_for_the_configured_time() -> None:
    from ray._private import node, ray_constants

    assert hasattr(ray_constants, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S")
    assert "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S" in node.Node._drain_node_before_shutdown.__doc__
    worker = _worker(_docs())
    drain = float(_env(worker, load("pods").DRAIN_ENV)["value"])
    graceful = max(d["graceful_shutdown_timeout_s"] for d in _app(yaml.safe_load(
        by_kind(_docs(), "RayService")[0]["spec"]["serveConfigV2"]))["deployments"])
    assert graceful >= 60 and drain >= graceful and worker["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert _container(worker)["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"


def test_the_dashboard_component_admits_only_labeled_pods_and_passes(tmp_path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    k8s = DEPLOY / "k8s"
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(k8s / "overlays" / "gpu")],
        "components": [str(k8s / "components" / "ray-dashboard-access")]}))
    docs = kl.render_lite(overlay)
    assert val.validate_docs(docs) == []
    head, worker = exposure.ray_pods(by_kind(docs, "RayService")[0])
    opt_in = next(p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("dashboard-access"))
    assert exposure.selects(opt_in["spec"]["podSelector"], head.labels)
    assert not exposure.selects(opt_in["spec"]["podSelector"], worker.labels)
    peer = opt_in["spec"]["ingress"][0]["from"][0]
    assert exposure.classify(peer, head) is exposure.Peer.NAMED_PODS and opt_in["spec"]["ingress"][0]["ports"] == [
        {"protocol": "TCP", "port": 8265}]


# --- the NetworkPolicy evaluator --------------------------------------------------------------------------

@pytest.mark.parametrize("selector,labels,expected", [
    ({}, {"a": "1"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
    ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
    ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {}, False),
    ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
    ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
])
def test_label_selectors_follow_kubernetes(selector: dict, labels: dict, expected: bool) -> None:
    assert exposure.selects(selector, labels) is expected


def test_peers_are_classified_from_the_ray_pods_point_of_view() -> None:
    head = exposure.ray_pods(by_kind(_docs(), "RayService")[0])[0]
    ray_only = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvserve"},
                                "matchExpressions": [{"key": "ray.io/node-type", "operator": "Exists"}]}}
    same_app = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "kvserve"}}}
    assert exposure.classify(ray_only, head) is exposure.Peer.RAY_PODS
    assert exposure.classify(same_app, head) is exposure.Peer.NAMED_PODS  # a non-Ray pod may carry that label
    assert exposure.classify({"podSelector": {}}, head) is exposure.Peer.ANYONE
    assert exposure.classify({"namespaceSelector": {}}, head) is exposure.Peer.ANYONE
    assert exposure.classify({"ipBlock": {"cidr": "10.0.0.0/8"}}, head) is exposure.Peer.ANYONE
    assert exposure.classify({"namespaceSelector": {"matchLabels": {"x": "y"}}}, head) is exposure.Peer.NAMESPACES
    assert exposure.classify(None, head) is exposure.Peer.ANYONE


# --- each rule, broken once -------------------------------------------------------------------------------

def _add(docs: list[dict], doc: dict) -> None:
    docs.append(doc)


BROKEN = [
    ("service on the dashboard port", "dashboard and Jobs API port",
     lambda d: _add(d, _service({"name": "http", "port": 80, "targetPort": 8265}))),
    ("service on the Ray client port", "Ray client port",
     lambda d: _add(d, _service({"name": "client", "port": 10001}))),
    ("service on GCS by port name", "GCS port",
     lambda d: _add(d, _service({"name": "gcs", "port": 6379, "targetPort": "gcs-server"}))),
    ("ingress to the dashboard", "routes outside traffic",
     lambda d: _add(d, {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
                        "metadata": {"name": "dash", "namespace": "kvserve"},
                        "spec": {"defaultBackend": {"service": {"name": "kvserve-head-svc",
                                                                "port": {"number": 8265}}}}})),
    ("client port on the head container", "head container port client",
     lambda d: _container(_head(d))["ports"].append({"name": "client", "containerPort": 10001})),
    ("LoadBalancer head service", "serviceType LoadBalancer", lambda d: _head(d).update(serviceType="LoadBalancer")),
    ("dashboard ingress", "enableIngress", lambda d: _head(d).update(enableIngress=True)),
    ("extra head service ports", "headService",
     lambda d: _head(d).update(headService={"spec": {"ports": [{"name": "client", "port": 10001}]}})),
    ("token auth off", "authOptions.mode must be token", lambda d: _cluster(d).pop("authOptions")),
    ("dashboard on loopback", "dashboard-host is loopback",
     lambda d: _head(d)["rayStartParams"].update({"dashboard-host": "127.0.0.1"})),
    ("no NetworkPolicy", "no NetworkPolicy selects the head",
     lambda d: d.remove(_policy(d))),
    ("policy for workers only", "no NetworkPolicy selects the head",
     lambda d: _policy(d)["spec"]["podSelector"].update(matchLabels={"ray.io/node-type": "worker"})),
    ("every port from every namespace", "admits every port",
     lambda d: _rules(d).append({"from": [{"namespaceSelector": {}}]})),
    ("internal rule on a bare app label", "admits every port",
     lambda d: _rules(d)[0]["from"][0]["podSelector"].pop("matchExpressions")),
    ("GCS from anyone", "admits port 6379",
     lambda d: _rules(d).append({"ports": [{"port": 6379}]})),
    ("Ray client from an address block", "admits port 10001",
     lambda d: _rules(d).append({"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}], "ports": [{"port": 10001}]})),
    ("a port range over the worker ports", "admits port 10002",
     lambda d: _rules(d).append({"ports": [{"port": 8000}, {"port": 10002, "endPort": 19999}]})),
    ("dashboard from a whole namespace", "admits port 8265",
     lambda d: _rules(d)[3]["from"][0].pop("podSelector")),
    ("dashboard by port name from anyone", "admits port 8265",
     lambda d: _rules(d).append({"ports": [{"port": "dashboard"}]})),
    ("metrics from anyone", "admits port 8080", lambda d: _rules(d)[2].pop("from")),
    ("serve port closed", "do not admit port 8000", lambda d: _rules(d).pop(1)),
    ("metrics closed", "do not admit port 8080", lambda d: _rules(d).pop(2)),
    ("operator cannot reach the dashboard", "from the KubeRay operator", lambda d: _rules(d).pop(3)),
    ("a shipped Secret", "a Secret in the manifests",
     lambda d: _add(d, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "kvserve-api-key",
                                                                           "namespace": "kvserve"},
                        "stringData": {"api-key": "hunter2"}})),
    ("an object outside the namespace", "not the RayService's",
     lambda d: _policy(d)["metadata"].update(namespace="default")),
    ("plaintext api key", "plaintext args.api_key",
     lambda d: _serve(d, lambda c: _app(c)["args"].update(api_key="hunter2"))),
    ("no key on 0.0.0.0", "with no API key",
     lambda d: _serve(d, lambda c: _app(c)["args"].pop("api_key_env"))),
    ("unbounded ingress queue", "'ingress': max_queued_requests=-1",
     lambda d: _serve(d, lambda c: _dep(c, "ingress").pop("max_queued_requests"))),
    ("explicitly unbounded ingress queue", "'ingress': max_queued_requests=-1",
     lambda d: _serve(d, lambda c: _dep(c, "ingress").update(max_queued_requests=-1))),
    ("explicitly unbounded queue", "'translate': max_queued_requests=-1",
     lambda d: _split_serve(d, lambda c: _dep(c, "translate").update(max_queued_requests=-1))),
    ("503 backpressure on the ingress", "deployment 'ingress': backpressure_config=",
     lambda d: _serve(d, lambda c: _dep(c, "ingress")["backpressure_config"].update(status_code=503))),
    ("503 backpressure", "deployment 'generate': backpressure_config=",
     lambda d: _split_serve(d, lambda c: _dep(c, "generate")["backpressure_config"].update(status_code=503))),
    ("no Retry-After", "must answer 429",
     lambda d: _serve(d, lambda c: _dep(c, "ingress")["backpressure_config"].pop("retry_after_s"))),
    ("a model without a deployment entry", "'generate' has no entry",
     lambda d: _split_serve(d, lambda c: _app(c)["deployments"].remove(_dep(c, "generate")))),
    ("a model taken out of the ingress without an entry", "'generate' has no entry",
     lambda d: _serve(d, _uncolocate_generate)),
    ("a canary without a deployment entry", "'generate-canary' has no entry",
     lambda d: _serve(d, lambda c: [m.update(canary={"bundle": "generate-next", "weight": 10})
                                    for m in _app(c)["args"]["models"] if m["name"] == "generate"])),
    ("worker without the key variable", "must take KVSERVE_API_KEY",
     lambda d: _drop_env(_worker(d), "KVSERVE_API_KEY")),
    ("key as a plain value", "must take KVSERVE_API_KEY",
     lambda d: _env(_worker(d), "KVSERVE_API_KEY").update(value="hunter2")),
    ("optional key Secret", "must take KVSERVE_API_KEY",
     lambda d: _env(_worker(d), "KVSERVE_API_KEY")["valueFrom"]["secretKeyRef"].update(optional=True)),
    ("head without the header guard", "group head: container ray-head needs env",
     lambda d: _drop_env(_head(d), "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH")),
    ("no preStop", "no lifecycle.preStop", lambda d: _container(_worker(d)).pop("lifecycle")),
    ("drain shorter than a graceful stop", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=30 must be",
     lambda d: _env(_worker(d), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S").update(value="30")),
    ("drain unset", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=unset",
     lambda d: _drop_env(_worker(d), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S")),
    ("grace period shorter than the drain", "terminationGracePeriodSeconds=60",
     lambda d: _worker(d)["template"]["spec"].update(terminationGracePeriodSeconds=60)),
    ("ingress stops before its streams end", "'ingress': graceful_shutdown_timeout_s=20",
     lambda d: _serve(d, lambda c: _dep(c, "ingress").update(graceful_shutdown_timeout_s=20))),
]


@pytest.fixture(scope="module")
def gpu_overlay_passes() -> None:
    """The unmutated gpu overlay passes: each case below breaks it in one place (checked once, not per case)."""
    assert val.validate_docs(_docs()) == []


@pytest.mark.parametrize("needle,mutate", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_validation_fails_when_a_rule_is_broken(needle: str, mutate, gpu_overlay_passes) -> None:
    docs = _docs()
    mutate(docs)
    errors = val.validate_docs(docs)
    assert any(needle in e for e in errors), errors


def test_the_local_config_needs_no_key_on_loopback_but_does_beyond_it() -> None:
    cfg = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text(encoding="utf-8"))
    _app(cfg)["args"].pop("api_key_env", None)
    cfg["http_options"]["host"] = "127.0.0.1"
    assert val.serve_safety_errors(cfg) == []
    cfg["http_options"]["host"] = "0.0.0.0"
    assert any("with no API key" in e for e in val.serve_safety_errors(cfg))
    assert any("'translate' serves an unpinned bundle" in e for e in val.serve_safety_errors(cfg))


def test_the_generator_refuses_a_plaintext_key_and_overrides_the_local_host() -> None:
    cfg = gen.load_serve_config()
    cfg["http_options"]["host"] = "127.0.0.1"
    out = gen.image_serve_config(cfg, gen.Variant.CPU)
    assert out["http_options"]["host"] == "0.0.0.0" and _app(out)["args"]["api_key_env"] == gen.API_KEY_ENV
    assert _dep(out, "ingress")["graceful_shutdown_timeout_s"] >= _app(out)["args"]["limits"]["request_timeout_s"]
    _app(cfg)["args"]["api_key"] = "hunter2"
    with pytest.raises(ValueError, match="plaintext args.api_key"):
        gen.image_serve_config(cfg, gen.Variant.CPU)


def test_every_ray_container_and_image_runs_with_the_servers_malloc_settings() -> None:
    """The RSS of a long-running server stays flat only with the arenas `kvserve serve` sets (docs/reliability.md)."""
    from serving.server.ray_env import MALLOC_ENV

    docs = _docs()
    for group in (_head(docs), _worker(docs)):
        for key, value in MALLOC_ENV.items():
            assert _env(group, key)["value"] == value
    for variant in ("cpu", "gpu"):
        text = (DEPLOY / "docker" / f"Dockerfile.{variant}").read_text()
        assert all(f"ENV {key}={value}\n" in text for key, value in MALLOC_ENV.items())
