"""deploy/: the Ray pods' least privilege, and that deploy/validate.py refuses less.

The shipped overlays pass; each mutation below breaks one rule and must fail with a message naming it: an
egress policy missing or open to more than the RayService's pods, DNS and (head only) the API server's
ports, the cloud metadata address reachable, what Ray needs no longer reachable, a ServiceAccount token
mounted into a Ray container, a writable root filesystem, no writable /tmp, a bundle without its pinned
content hash. The egress evaluator is checked on Kubernetes' semantics, and the autoscaler's token mount
against what the pinned Ray reads.
"""
from __future__ import annotations

import json
import os

import pytest
import yaml
from deploy_helpers import (head_group as _head, ray_cluster as _cluster, rendered_copy as _docs,
                            worker_group as _worker, OVERLAYS, by_kind, load)

val = load("validate")
egress = load("egress")
exposure = load("exposure")
pods = load("pods")
gen = load("gen_rayservice")


def _spec(group: dict) -> dict:
    return group["template"]["spec"]


def _container(group: dict) -> dict:
    return _spec(group)["containers"][0]


def _policy(docs: list[dict], name: str) -> dict:
    return next(d for d in by_kind(docs, "NetworkPolicy") if d["metadata"]["name"] == name)


def _egress(docs: list[dict]) -> list[dict]:
    """The rules of kvserve-ray-egress: [0] the RayService's pods, [1] DNS."""
    return _policy(docs, "kvserve-ray-egress")["spec"]["egress"]


def _api_server(docs: list[dict]) -> dict:
    return _policy(docs, "kvserve-ray-head-api-server")


def _api_block(docs: list[dict]) -> dict:
    return _api_server(docs)["spec"]["egress"][0]["to"][0]["ipBlock"]


# --- the repository's files ---------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_shipped_overlays_pass_the_least_privilege_rules(overlay: str) -> None:
    docs = _docs(overlay)
    assert egress.check(docs) == [] and pods.privilege_errors(_cluster(docs)) == []
    assert val.validate_docs(docs) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_ray_container_holds_a_token_and_every_root_filesystem_is_read_only(overlay: str) -> None:
    cluster = _cluster(_docs(overlay))
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = _spec(group)
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert volumes[mounts["/tmp"]] == {"name": mounts["/tmp"], "emptyDir": {}}
            assert not any("projected" in volumes[name] for name in mounts.values())
    assert cluster["autoscalerOptions"]["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_autoscaler_alone_mounts_the_token_where_the_pinned_ray_reads_it() -> None:
    """Ray's KubeRay node provider reads the token and the cluster CA from one directory: the autoscaler's
    mount of the head's projected token volume must put both there, read-only."""
    from ray.autoscaler._private.kuberay import node_provider

    cluster = _cluster(_docs())
    token_dir = os.path.dirname(node_provider.IN_CLUSTER_TOKEN_PATH)
    assert os.path.dirname(node_provider.IN_CLUSTER_CA_CERT_PATH) == token_dir
    mount = next(m for m in cluster["autoscalerOptions"]["volumeMounts"] if m["mountPath"] == token_dir)
    assert mount["readOnly"] is True
    volume = next(v for v in _spec(cluster["headGroupSpec"])["volumes"] if v["name"] == mount["name"])
    sources = volume["projected"]["sources"]
    files = {s["serviceAccountToken"]["path"] for s in sources if "serviceAccountToken" in s}
    files |= {i["path"] for s in sources if "configMap" in s for i in s["configMap"]["items"]}
    assert {os.path.basename(node_provider.IN_CLUSTER_TOKEN_PATH),
            os.path.basename(node_provider.IN_CLUSTER_CA_CERT_PATH)} <= files


def test_only_the_head_may_reach_the_api_server_ports_and_nobody_the_metadata_address() -> None:
    docs = _docs()
    head, worker = exposure.ray_pods(by_kind(docs, "RayService")[0])
    selector = _api_server(docs)["spec"]["podSelector"]
    assert exposure.selects(selector, head.labels) and not exposure.selects(selector, worker.labels)
    for policy in by_kind(docs, "NetworkPolicy"):
        for rule in policy["spec"].get("egress", []):
            for peer in rule["to"]:
                assert "ipBlock" not in peer or not egress.holds_metadata_address(peer["ipBlock"])
    assert _api_server(docs)["spec"]["egress"][0]["ports"] == [{"protocol": "TCP", "port": 443},
                                                                {"protocol": "TCP", "port": 6443}]


def test_a_cluster_without_the_autoscaler_must_not_let_its_head_reach_the_api_server() -> None:
    docs = _docs()
    _cluster(docs)["enableInTreeAutoscaling"] = False
    errors = egress.check(docs)
    assert any("head pods reach port 443" in e for e in errors), errors
    docs.remove(_api_server(docs))
    assert egress.check(docs) == []


# --- the egress evaluator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block,expected", [
    ({"cidr": "0.0.0.0/0"}, True),
    ({"cidr": "169.254.169.254/32"}, True),
    ({"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}, False),
    ({"cidr": "0.0.0.0/0", "except": ["169.254.169.254/32"]}, False),
    ({"cidr": "0.0.0.0/0", "except": ["169.254.169.0/30"]}, True),
    ({"cidr": "10.0.0.0/8"}, False),
    ({"cidr": "::/0"}, False),
])
def test_the_metadata_address_is_found_in_address_blocks(block: dict, expected: bool) -> None:
    assert egress.holds_metadata_address(block) is expected


@pytest.mark.parametrize("spec,types", [
    ({"ingress": []}, ["Ingress"]),
    ({"egress": []}, ["Ingress", "Egress"]),
    ({"policyTypes": ["Egress"], "ingress": [{}]}, ["Egress"]),
])
def test_policy_types_default_as_in_kubernetes(spec: dict, types: list[str]) -> None:
    assert egress.policy_types({"spec": spec}) == types


def test_destinations_are_classified_from_the_ray_pods_point_of_view() -> None:
    head = exposure.ray_pods(by_kind(_docs(), "RayService")[0])[0]
    dns = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
           "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    kind = egress.Destination
    assert egress.destination(dns, head) is kind.NAMED_PODS
    assert egress.destination({"namespaceSelector": dns["namespaceSelector"]}, head) is kind.NAMESPACES
    assert egress.destination({"podSelector": {}}, head) is kind.ANYWHERE
    assert egress.destination(None, head) is kind.ANYWHERE
    assert egress.destination(_egress(_docs())[0]["to"][0], head) is kind.RAY_PODS
    assert egress.destination({"ipBlock": {"cidr": "10.0.0.1/32"}}, head) is kind.ADDRESSES
    assert egress.destination({"ipBlock": {"cidr": "169.254.0.0/16"}}, head) is kind.METADATA


# --- each rule, broken once -------------------------------------------------------------------------------

def _remove(docs: list[dict], name: str) -> None:
    docs.remove(_policy(docs, name))


def _mount(group: dict, path: str) -> dict:
    return next(m for m in _container(group)["volumeMounts"] if m["mountPath"] == path)


BROKEN = [
    ("no egress policy", "no egress NetworkPolicy selects the worker group gpu-workers pods",
     lambda d: _remove(d, "kvserve-ray-egress")),
    ("the egress policy typed Ingress", "no egress NetworkPolicy selects the worker group",
     lambda d: _policy(d, "kvserve-ray-egress")["spec"].update(policyTypes=["Ingress"])),
    ("a rule to anywhere", "reach every port of anywhere", lambda d: _egress(d).append({})),
    ("every port of every pod", "reach every port of {\"podSelector\": {}}",
     lambda d: _egress(d).append({"to": [{"podSelector": {}}]})),
    ("the metadata address", "holding the cloud metadata address",
     lambda d: _egress(d).append({"to": [{"ipBlock": {"cidr": "169.254.169.254/32"}}], "ports": [{"port": 80}]})),
    ("the API server block without its exception", "reach port 443 of",
     lambda d: _api_block(d).pop("except")),
    ("the API server ports for the workers", "worker group gpu-workers pods reach port 443",
     lambda d: _api_server(d)["spec"]["podSelector"]["matchLabels"].pop("ray.io/node-type")),
    ("another port of the API server's block", "reach port 8443",
     lambda d: _api_server(d)["spec"]["egress"][0]["ports"].append({"protocol": "TCP", "port": 8443})),
    ("a port range over the API server's", "reach port 444",
     lambda d: _api_server(d)["spec"]["egress"][0]["ports"].append({"port": 443, "endPort": 6443})),
    ("DNS from every pod of kube-system", "(every pod of named namespaces)",
     lambda d: _egress(d)[1]["to"][0].pop("podSelector")),
    ("DNS by port name", "name egress ports by number",
     lambda d: _egress(d)[1]["ports"].append({"protocol": "UDP", "port": "dns"})),
    ("no DNS", "reach DNS over UDP port 53", lambda d: _egress(d).pop(1)),
    ("DNS over TCP only", "reach DNS over UDP port 53", lambda d: _egress(d)[1]["ports"].pop(0)),
    ("no Ray between the pods", "reach the RayService's pods", lambda d: _egress(d).pop(0)),
    ("Ray pods on a bare app label", "(pods named by label)",
     lambda d: _egress(d)[0]["to"][0]["podSelector"].pop("matchExpressions")),
    ("the head cut from the API server", "head pods reach the Kubernetes API server",
     lambda d: _remove(d, "kvserve-ray-head-api-server")),
    ("worker token mounted (field absent)", "group gpu-workers: automountServiceAccountToken is unset",
     lambda d: _spec(_worker(d)).pop("automountServiceAccountToken")),
    ("head token mounted", "group head: automountServiceAccountToken is True",
     lambda d: _spec(_head(d)).update(automountServiceAccountToken=True)),
    ("the token volume in ray-head", "container ray-head mounts the ServiceAccount token volume",
     lambda d: _container(_head(d))["volumeMounts"].append(
         {"name": "autoscaler-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})),
    ("worker root writable (field absent)", "container ray-worker: securityContext.readOnlyRootFilesystem",
     lambda d: _container(_worker(d))["securityContext"].pop("readOnlyRootFilesystem")),
    ("head root writable", "container ray-head: securityContext.readOnlyRootFilesystem",
     lambda d: _container(_head(d))["securityContext"].update(readOnlyRootFilesystem=False)),
    ("autoscaler root writable", "autoscalerOptions (the autoscaler container): securityContext.readOnly",
     lambda d: _cluster(d)["autoscalerOptions"]["securityContext"].pop("readOnlyRootFilesystem")),
    ("an init container with a writable root", "container fetch: securityContext.readOnlyRootFilesystem",
     lambda d: _spec(_worker(d)).update(initContainers=[{"name": "fetch", "image": "busybox:1.36"}])),
    ("no /tmp on the workers", "nothing writable is mounted at /tmp",
     lambda d: _container(_worker(d))["volumeMounts"].remove(_mount(_worker(d), "/tmp"))),
    ("a read-only /tmp", "nothing writable is mounted at /tmp",
     lambda d: _mount(_head(d), "/tmp").update(readOnly=True)),
    ("a mount without its volume", "volumeMount tmp names no volume",
     lambda d: _spec(_worker(d)).update(volumes=[v for v in _spec(_worker(d))["volumes"] if v["name"] != "tmp"])),
]


@pytest.mark.parametrize("needle,mutate", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_validation_fails_when_a_least_privilege_rule_is_broken(needle: str, mutate) -> None:
    docs = _docs()
    mutate(docs)
    errors = val.validate_docs(docs)
    assert any(needle in e for e in errors), errors


def test_the_shipped_configs_pin_the_published_bundles_and_an_unpinned_one_fails_deploy_check() -> None:
    """Every model of the images' and the RayService's configs carries its published bundle's content hash (what
    `make serve` exports, what `kvserve bundle-hash` prints); validation refuses the manifests without it."""
    for variant in gen.Variant:
        for model in gen.image_serve_config(gen.load_serve_config(), variant)["applications"][0]["args"]["models"]:
            published = json.loads((gen.PUBLISHED / model["bundle"] / "manifest.json").read_text())
            assert model["bundle_sha256"] == published["bundle"]["sha256"]
            assert model["bundle_sha256"].startswith(published["version"])
    docs = _docs()
    assert val.validate_docs(docs) == []
    service = next(d for d in docs if d.get("kind") == "RayService")
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    del serve["applications"][0]["args"]["models"][0]["bundle_sha256"]
    service["spec"]["serveConfigV2"] = yaml.safe_dump(serve)
    assert any("serves an unpinned bundle" in e for e in val.validate_docs(docs))

