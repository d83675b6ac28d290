"""Where kvserve's Ray pods may open connections, checked offline (deploy/validate.py).

Owns the egress rules of the RayService's pods, evaluated the way Kubernetes does: a pod selected by no
policy of type Egress may connect anywhere; one that is selected may connect where the union of those
policies' egress rules admits. For the head and every worker group:
- an egress policy selects it;
- it may reach the RayService's own pods on any port (GCS, raylets, object transfer, workers, Serve's HAProxy)
  and port 53 (DNS) of pods named by label or of an address block;
- the head, where KubeRay runs the autoscaler, may also reach ports 443 and 6443 (the Kubernetes API server) of
  an address block;
- nothing else: no rule open to every destination, no address block that holds the cloud metadata address
  169.254.169.254, no other port;
- what Ray needs stays admitted: its own pods, DNS over UDP, and the API server for the head's autoscaler.

`check(docs)` returns every problem; each message names the policy rule, the destination and the fix. Not here:
what may connect to the pods (deploy/exposure.py), the pods' own settings (deploy/pods.py).
"""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

Doc = dict[str, Any]

METADATA_ADDRESS = ipaddress.ip_address("169.254.169.254")
DNS_PORT = 53
API_SERVER_PORTS = (443, 6443)  # managed clusters; kubeadm and k3s


class Destination(Enum):
    """Where one egress rule's `to` entry lets a Ray pod connect."""
    RAY_PODS = "the RayService's pods"
    NAMED_PODS = "pods named by label"
    ADDRESSES = "an address block"
    METADATA = "an address block holding the cloud metadata address 169.254.169.254"
    NAMESPACES = "every pod of named namespaces"
    ANYWHERE = "anywhere"


class Needed(Enum):
    """What must stay reachable, or Ray stops working."""
    RAY = "the RayService's pods (Ray's GCS, raylets, object transfer, Serve)"
    DNS = "DNS over UDP port 53 (the workers find the head by its Service's name)"
    API_SERVER = "the Kubernetes API server on port 443 or 6443 (the autoscaler adds and removes worker pods)"


def _exposure() -> ModuleType:
    """deploy/exposure.py, whose Ray pods and label selector rules these checks share (deploy/ holds scripts,
    not a package: imported by path, under the name deploy/validate.py gives it)."""
    name = "kvserve_deploy_exposure"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("exposure.py"))
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def check(docs: list[Doc]) -> list[str]:
    """Every egress problem in one rendered overlay."""
    exposure = _exposure()
    policies = [d for d in docs if d.get("kind") == "NetworkPolicy"]
    errors = []
    for rayservice in (d for d in docs if d.get("kind") == "RayService"):
        namespace = rayservice["metadata"].get("namespace")
        autoscaler = bool(rayservice["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling"))
        ours = [p for p in policies if p["metadata"].get("namespace") == namespace]
        for pod in exposure.ray_pods(rayservice):
            errors += egress_errors(pod, ours, api_server=pod.is_head and autoscaler)
    return errors


def policy_types(policy: Doc) -> list[str]:
    """A policy's types; Kubernetes' default is Ingress, plus Egress when the policy has egress rules."""
    spec = policy.get("spec") or {}
    if "policyTypes" in spec:
        return list(spec["policyTypes"])
    return ["Ingress", "Egress"] if "egress" in spec else ["Ingress"]


def holds_metadata_address(block: Doc) -> bool:
    """Whether an ipBlock admits 169.254.169.254 (its cidr holds it and no `except` entry takes it out)."""
    def holds(cidr: str) -> bool:
        network = ipaddress.ip_network(cidr, strict=False)
        return network.version == METADATA_ADDRESS.version and METADATA_ADDRESS in network

    return holds(block["cidr"]) and not any(holds(e) for e in block.get("except") or [])


def destination(peer: Doc | None, pod: Any) -> Destination:
    """Where one `to` entry lets `pod` connect; None (a rule without `to`) means anywhere."""
    if not peer:
        return Destination.ANYWHERE
    if "ipBlock" in peer:
        try:
            return Destination.METADATA if holds_metadata_address(peer["ipBlock"]) else Destination.ADDRESSES
        except ValueError:  # not a CIDR: the API server refuses it; no address is known to be left out
            return Destination.ANYWHERE
    peer_kind = _exposure().Peer
    return {peer_kind.RAY_PODS: Destination.RAY_PODS, peer_kind.NAMED_PODS: Destination.NAMED_PODS,
            peer_kind.NAMESPACES: Destination.NAMESPACES}.get(_exposure().classify(peer, pod), Destination.ANYWHERE)


def allowed(port: int, where: Destination, api_server: bool) -> bool:
    """Whether a Ray pod may connect to `port` at `where` (any port of the RayService's pods: Ray picks them)."""
    if where is Destination.RAY_PODS:
        return True
    if port == DNS_PORT:
        return where in (Destination.NAMED_PODS, Destination.ADDRESSES)
    return api_server and port in API_SERVER_PORTS and where is Destination.ADDRESSES


def _rules(policies: list[Doc]) -> Iterator[tuple[str, Doc]]:
    for policy in policies:
        for i, rule in enumerate((policy.get("spec") or {}).get("egress") or []):
            yield f"policy/{policy['metadata'].get('name')} egress[{i}]", rule


def _describe(peer: Doc | None) -> str:
    return json.dumps(peer, sort_keys=True) if peer else "anywhere (no `to`)"


def _fix(port: int | None, api_server: bool) -> str:
    """What a rule may admit instead; `port` None: the rule admits every port."""
    if port == DNS_PORT:
        return "DNS may go only to pods named by label (kube-dns) or an address block without the metadata address"
    if port in API_SERVER_PORTS and api_server:
        return "the API server's ports may go only to an address block without 169.254.169.254"
    where = "the RayService's pods, DNS and the API server's ports" if api_server else "the RayService's pods and DNS"
    return f"{'list the ports: ' if port is None else ''}these pods may connect only to {where}"


def egress_errors(pod: Any, policies: list[Doc], api_server: bool) -> list[str]:
    """What the egress policies of the pod's namespace let one kind of Ray pod reach, against the rules above;
    `api_server`: the pod runs the autoscaler, which needs the Kubernetes API server."""
    selecting = [p for p in policies if _exposure().selects((p.get("spec") or {}).get("podSelector"), pod.labels)
                 and "Egress" in policy_types(p)]
    if not selecting:
        return [f"no egress NetworkPolicy selects the {pod.role} pods: they may connect anywhere, the Kubernetes API "
                f"server and the cloud metadata address 169.254.169.254 included; keep "
                f"deploy/k8s/base/networkpolicy-egress.yaml"]
    errors, seen = [], set()
    for where, rule in _rules(selecting):
        # a port named rather than numbered names the destination's port of that name: reported just below
        ports = _exposure().port_ranges(rule, lambda port: port if isinstance(port, int) else None)
        named = [e["port"] for e in rule.get("ports") or [] if isinstance(e.get("port"), str)]
        if named:
            errors.append(f"{where}: port names {named}: name egress ports by number (a name means the "
                          f"destination's port of that name, which no check here can see)")
        for peer in rule.get("to") or [None]:
            kind = destination(peer, pod)
            if kind is Destination.RAY_PODS:
                seen.add(Needed.RAY)
                continue
            if ports is None:
                errors.append(f"{where}: lets the {pod.role} pods reach every port of {_describe(peer)} "
                              f"({kind.value}); {_fix(None, api_server)}")
                continue
            for protocol, lo, hi in ports:
                bad = next((p for p in range(lo, hi + 1) if not allowed(p, kind, api_server)), None)
                if bad is not None:
                    errors.append(f"{where}: lets the {pod.role} pods reach port {bad} of {_describe(peer)} "
                                  f"({kind.value}); {_fix(bad, api_server)}")
                    continue
                if protocol == "UDP" and lo <= DNS_PORT <= hi:
                    seen.add(Needed.DNS)
                if any(lo <= p <= hi for p in API_SERVER_PORTS) and api_server:
                    seen.add(Needed.API_SERVER)
    needed = {Needed.RAY, Needed.DNS} | ({Needed.API_SERVER} if api_server else set())
    return errors + [f"the egress NetworkPolicies do not let the {pod.role} pods reach {n.value}"
                     for n in sorted(needed - seen, key=lambda n: n.name)]
