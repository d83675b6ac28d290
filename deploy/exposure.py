"""What kvserve's rendered manifests expose to the rest of the cluster, checked offline (deploy/validate.py).

Owns the rules that keep Ray's control plane (GCS 6379, dashboard and Jobs API 8265, Ray client 10001, the
raylets' and workers' ports) reachable only from the RayService's own pods and, for the dashboard, the KubeRay
operator, while Serve's HTTP port (8000) stays open to clients and the metrics port (8080) to Prometheus:
- Services and Ingresses never route to a Ray control port. KubeRay builds the head Service from the head
  container's ports, so those are held to what Ray and the operator need: GCS (workers join through it),
  dashboard (the operator deploys serveConfigV2 there), serve, metrics; never the Ray client port. No
  NodePort or LoadBalancer head Service, no dashboard Ingress (`enableIngress`), no extra ports through
  `headService` or `serveService`.
- Ray token authentication is on (`authOptions.mode: token`), and the dashboard listens where the operator
  reaches it (not loopback: with 127.0.0.1 the RayService never deploys).
- NetworkPolicies, evaluated the way Kubernetes does (a pod admits the union of the rules of every policy that
  selects it): the head and every worker group must be selected; a port other than 8000 may be admitted from
  outside the RayService's pods only for metrics (8080, from named namespaces or pods) and the dashboard
  (8265, from pods named by label); and 8000, 8080 and the operator's 8265 must stay admitted.
- No Secret objects: secrets are created in the cluster, never shipped.

`check(docs)` returns every problem; each message names the object, the port and the fix. Not here: schemas,
KubeRay and Serve config facts (deploy/validate.py).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

Doc = dict[str, Any]

SERVE_PORT = 8000
METRICS_PORT = 8080
DASHBOARD_PORT = 8265
# Ray's control-plane ports (`ray start` defaults, which KubeRay keeps) and the names KubeRay gives them.
CONTROL_PORTS = {6379: "GCS", DASHBOARD_PORT: "dashboard and Jobs API", 10001: "Ray client",
                 52365: "dashboard agent"}
CONTROL_PORT_NAMES = {"gcs-server": 6379, "dashboard": DASHBOARD_PORT, "client": 10001, "dashboard-agent": 52365}
# What the head container may list (KubeRay copies the list onto the head Service): what Ray and KubeRay need.
HEAD_PORTS = {"gcs-server": 6379, "dashboard": DASHBOARD_PORT, "serve": SERVE_PORT, "metrics": METRICS_PORT}
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kuberay-operator"}  # the kuberay-operator Helm chart's pods
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
# Labels KubeRay sets on every Ray pod; the pod template cannot override these three.
_FIXED_RAY_LABELS = ("ray.io/node-type", "ray.io/group", "ray.io/cluster")


class Peer(Enum):
    """Who an ingress rule's `from` entry admits, from the Ray pods' point of view."""
    RAY_PODS = "the RayService's pods"
    NAMED_PODS = "pods named by label"
    NAMESPACES = "pods of named namespaces"
    ANYONE = "anyone"


@dataclass(frozen=True)
class RayPod:
    """A kind of pod KubeRay creates for the RayService: its labels and its container's named ports."""
    role: str
    labels: dict[str, str]
    ports: dict[str, int]
    is_head: bool


def check(docs: list[Doc]) -> list[str]:
    """Every exposure problem in one rendered overlay."""
    errors = [f"{_name(d)}: a Secret in the manifests ships its value to everyone who reads them; create it in "
              f"the cluster instead (deploy/README.md, Security)" for d in docs if d.get("kind") == "Secret"]
    for doc in docs:
        if doc.get("kind") == "Service":
            errors += _service_errors(doc)
        elif doc.get("kind") == "Ingress":
            errors += _ingress_errors(doc)
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    for rayservice in (d for d in docs if d.get("kind") == "RayService"):
        errors += _rayservice_errors(rayservice)
        namespace = rayservice["metadata"].get("namespace")
        for pod in ray_pods(rayservice):
            errors += policy_errors(pod, [p for p in policies if p["metadata"].get("namespace") == namespace])
    return errors


def _name(doc: Doc) -> str:
    return f"{doc.get('kind', '?').lower()}/{doc.get('metadata', {}).get('name', '?')}"


def _control_port(value: Any) -> int | None:
    number = CONTROL_PORT_NAMES.get(value) if isinstance(value, str) else value
    return number if number in CONTROL_PORTS else None


def _service_errors(doc: Doc) -> list[str]:
    errors = []
    for port in doc.get("spec", {}).get("ports") or []:
        for value in {port.get("port"), port.get("targetPort", port.get("port"))}:
            number = _control_port(value)
            if number:
                errors.append(f"{_name(doc)}: exposes Ray's {CONTROL_PORTS[number]} port ({value}) to every pod "
                              f"that can reach the Service; only Serve (8000) and metrics (8080) belong behind "
                              f"one (KubeRay's own head Service carries GCS and the dashboard for Ray)")
    return errors


def _ingress_errors(doc: Doc) -> list[str]:
    spec = doc.get("spec", {})
    backends = [spec.get("defaultBackend")] + [p.get("backend") for r in spec.get("rules") or []
                                               for p in (r.get("http") or {}).get("paths") or []]
    errors = []
    for backend in filter(None, backends):
        port = (backend.get("service") or {}).get("port") or {}
        number = _control_port(port.get("number", port.get("name")))
        if number:
            errors.append(f"{_name(doc)}: routes outside traffic to Ray's {CONTROL_PORTS[number]} port; expose "
                          f"only the Serve Service (kvserve-serve-svc, port 8000)")
    return errors


def _rayservice_errors(doc: Doc) -> list[str]:
    spec, where = doc["spec"], _name(doc)
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    errors = []
    for port in head["template"]["spec"]["containers"][0].get("ports") or []:
        if HEAD_PORTS.get(port.get("name")) != port["containerPort"]:
            errors.append(f"{where}: head container port {port.get('name')} ({port['containerPort']}): KubeRay puts "
                          f"every head container port on the head Service; keep only {HEAD_PORTS}")
    if head.get("serviceType", "ClusterIP") != "ClusterIP":
        errors.append(f"{where}: headGroupSpec.serviceType {head['serviceType']} publishes GCS and the dashboard "
                      f"beyond the cluster; leave it ClusterIP and expose only the Serve Service")
    if head.get("enableIngress"):
        errors.append(f"{where}: headGroupSpec.enableIngress creates an Ingress to the dashboard; remove it")
    extra = head.get("headService") or {}
    if extra.get("spec", {}).get("type", "ClusterIP") != "ClusterIP" or extra.get("spec", {}).get("ports"):
        errors.append(f"{where}: headGroupSpec.headService adds ports or a type to the head Service; remove it")
    for port in (spec.get("serveService") or {}).get("spec", {}).get("ports") or []:
        if port.get("port") != SERVE_PORT or _control_port(port.get("targetPort")):
            errors.append(f"{where}: serveService port {port}: the Serve Service carries port {SERVE_PORT} only")
    if (cluster.get("authOptions") or {}).get("mode") != "token":
        errors.append(f"{where}: rayClusterConfig.authOptions.mode must be token: without Ray's token anyone who "
                      f"reaches the dashboard, Jobs API or GCS can run code in the cluster")
    if head.get("rayStartParams", {}).get("dashboard-host", "0.0.0.0") in LOOPBACK:
        errors.append(f"{where}: headGroupSpec.rayStartParams.dashboard-host is loopback, but the KubeRay operator "
                      f"deploys serveConfigV2 through the dashboard on the head Service; keep 0.0.0.0 (the "
                      f"NetworkPolicy and the token restrict it)")
    return errors


def ray_pods(rayservice: Doc) -> list[RayPod]:
    """The head and one pod per worker group, with the labels KubeRay gives them (ray.io/cluster is a
    generated name, unknown here: a selector on it would break at the next NewCluster upgrade anyway)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", "headgroup", cluster["headGroupSpec"])]
    groups += [("worker", g["groupName"], g) for g in cluster.get("workerGroupSpecs") or []]
    pods = []
    for node_type, group_name, group in groups:
        template = group["template"]
        labels = {"ray.io/is-ray-node": "yes", "app.kubernetes.io/name": "kuberay",
                  "app.kubernetes.io/created-by": "kuberay-operator"}
        labels.update((template.get("metadata") or {}).get("labels") or {})
        labels.update({"ray.io/node-type": node_type, "ray.io/group": group_name,
                       "ray.io/cluster": f"{rayservice['metadata']['name']}-<generated>"})
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0].get("ports") or []
                 if p.get("name")}
        role = "head" if node_type == "head" else f"worker group {group_name}"
        pods.append(RayPod(role, labels, ports, node_type == "head"))
    return pods


def selects(selector: Doc | None, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels and matchExpressions) matches `labels`."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        matched = {"In": present and labels.get(key) in values, "NotIn": not present or labels[key] not in values,
                   "Exists": present, "DoesNotExist": not present}.get(op, False)
        if not matched:
            return False
    return True


def _non_ray_pods(pod: RayPod) -> list[dict[str, str]]:
    """Label sets of pods that are not Ray pods: unlabeled, or carrying the template's labels without KubeRay's."""
    own = {k: v for k, v in pod.labels.items() if not k.startswith("ray.io/") and k != "app.kubernetes.io/created-by"}
    return [{}, own]


def classify(peer: Doc | None, pod: RayPod) -> Peer:
    """Who one `from` entry admits; None (a rule without `from`) admits anyone."""
    if not peer or "ipBlock" in peer:
        return Peer.ANYONE
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None and pods is not None and selects(pods, pod.labels) \
            and not any(selects(pods, other) for other in _non_ray_pods(pod)):
        return Peer.RAY_PODS
    if pods and (pods.get("matchLabels") or pods.get("matchExpressions")):
        return Peer.NAMED_PODS
    if namespaces and (namespaces.get("matchLabels") or namespaces.get("matchExpressions")):
        return Peer.NAMESPACES
    return Peer.ANYONE  # podSelector {} or namespaceSelector {}: every pod of a namespace or of the cluster


def admitted(port: int, peer: Peer) -> bool:
    """Whether `port` of a Ray pod may be reachable from `peer`."""
    if peer is Peer.RAY_PODS or port == SERVE_PORT:
        return True
    if port == METRICS_PORT:
        return peer in (Peer.NAMED_PODS, Peer.NAMESPACES)
    return port == DASHBOARD_PORT and peer is Peer.NAMED_PODS


def port_ranges(rule: Doc, number: Callable[[int | str], int | None]) -> list[tuple[str, int, int]] | None:
    """(protocol, first, last) of each port entry of one NetworkPolicy rule (ingress or egress); None means every
    port. `number` gives an entry's port as a number, or None when the entry names none (a name the pod lacks)."""
    if not rule.get("ports"):
        return None
    ranges = []
    for entry in rule["ports"]:
        if "port" not in entry:
            return None
        if (first := number(entry["port"])) is not None:
            ranges.append((entry.get("protocol", "TCP"), first, entry.get("endPort", first)))
    return ranges


def _port_ranges(rule: Doc, pod: RayPod) -> list[tuple[int, int]] | None:
    """The port ranges one ingress rule admits on `pod` (a port name the pod does not have admits nothing)."""
    ranges = port_ranges(rule, lambda port: pod.ports.get(port) if isinstance(port, str) else port)
    return None if ranges is None else [(lo, hi) for _, lo, hi in ranges]


def _isolating(policies: list[Doc], pod: RayPod) -> list[Doc]:
    """The policies that restrict what reaches `pod` (policyTypes defaults to Ingress)."""
    return [p for p in policies if selects(p.get("spec", {}).get("podSelector"), pod.labels)
            and "Ingress" in p.get("spec", {}).get("policyTypes", ["Ingress"])]


def _rules(policies: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for policy in policies:
        for i, rule in enumerate(policy.get("spec", {}).get("ingress") or []):
            yield f"{_name(policy)} ingress[{i}]", rule


def _describe(peer: Doc | None) -> str:
    return json.dumps(peer, sort_keys=True) if peer else "anyone (no `from`)"


def policy_errors(pod: RayPod, policies: list[Doc]) -> list[str]:
    """What the NetworkPolicies of the pod's namespace admit to one kind of Ray pod, against the rules above."""
    selecting = _isolating(policies, pod)
    if not selecting:
        return [f"no NetworkPolicy selects the {pod.role} pods: every pod in the cluster reaches Ray's GCS (6379), "
                f"dashboard (8265) and client (10001) ports; keep deploy/k8s/base/networkpolicy.yaml"]
    errors, seen = [], set()
    for where, rule in _rules(selecting):
        ranges = _port_ranges(rule, pod)
        for peer in rule.get("from") or [None]:
            kind = classify(peer, pod)
            if ranges is None and kind is not Peer.RAY_PODS:
                errors.append(f"{where}: admits every port of the {pod.role} pods from {_describe(peer)}; Ray's "
                              f"control ports {sorted(CONTROL_PORTS)} must be reachable only from the RayService's "
                              f"pods: list the ports ({SERVE_PORT} serve, {METRICS_PORT} metrics)")
            for lo, hi in ranges or []:
                bad = next((p for p in range(lo, hi + 1) if not admitted(p, kind)), None)
                if bad is not None:
                    errors.append(f"{where}: admits port {bad} of the {pod.role} pods from {_describe(peer)}"
                                  f"{f' ({kind.value})' if peer else ''}; {_why(bad)}")
                seen |= {(p, kind, _is_operator(peer)) for p in (SERVE_PORT, METRICS_PORT, DASHBOARD_PORT)
                         if lo <= p <= hi}
    return errors + _missing(pod, seen)


def _is_operator(peer: Doc | None) -> bool:
    return bool(peer) and "podSelector" in peer and selects(peer["podSelector"], OPERATOR_POD_LABELS) \
        and bool(peer["podSelector"].get("matchLabels"))


def _why(port: int) -> str:
    if port == METRICS_PORT:
        return "admit the metrics port from Prometheus's namespace or pods only"
    if port == DASHBOARD_PORT:
        return "admit the dashboard only from pods named by label (the KubeRay operator)"
    what = CONTROL_PORTS.get(port, "Ray's")
    return f"{what} port: outside the RayService's pods only {SERVE_PORT} (Serve) may be open to everyone"


def _missing(pod: RayPod, seen: set[tuple[int, Peer, bool]]) -> list[str]:
    """What must stay admitted, or kvserve stops working: Serve for clients, metrics, the operator's dashboard."""
    errors = []
    if not pod.is_head and (SERVE_PORT, Peer.ANYONE, False) not in seen:
        errors.append(f"the NetworkPolicies do not admit port {SERVE_PORT} of the {pod.role} pods from outside the "
                      f"RayService: the Serve Service, your Ingress and the clients could not connect")
    if not any(p == METRICS_PORT and k is not Peer.RAY_PODS for p, k, _ in seen):
        errors.append(f"the NetworkPolicies do not admit port {METRICS_PORT} of the {pod.role} pods from "
                      f"Prometheus: the PodMonitors could not scrape")
    if pod.is_head and not any(p == DASHBOARD_PORT and operator for p, _, operator in seen):
        errors.append(f"the NetworkPolicies do not admit port {DASHBOARD_PORT} of the head from the KubeRay operator "
                      f"(pods labeled {OPERATOR_POD_LABELS}): the RayService would never deploy serveConfigV2")
    return errors
