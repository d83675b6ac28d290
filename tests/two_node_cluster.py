"""A two-node Ray cluster on this machine, a raylet killed under load: the scenario of tests/test_two_node.py.

Run as its own process (it owns its Ray cluster, apart from the one pytest's fixtures start): `python tests/two_node_cluster.py
ARTIFACTS`. Ray's `cluster_utils.Cluster` starts a head node and a second node on this host, each with its
own raylet; the Serve config (deploy/serve_config.yaml reduced to `generate`) puts one `generate` replica
on each node (max_replicas_per_node: 1) and the proxy on the head. While 200 plain and streamed
`/v1/generate` requests run, the second node's raylet gets SIGKILL, taking that node's replica with it. Prints
one JSON line: every request's status, whether it hung, and whether the model serves afterwards.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
REQUESTS, CONCURRENCY, DEADLINE_S = 200, 20, 20.0
BODY = {"prompt": "the quick brown fox", "max_tokens": 48, "ignore_eos": True, "seed": 7, "temperature": 1.0}


def config(art: Path, port: int) -> dict:
    cfg = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg["proxy_location"] = "HeadOnly"  # one HTTP port on this host; each node would bind it otherwise
    cfg["http_options"].update(port=port, host="127.0.0.1")
    app = cfg["applications"][0]
    app["args"].update(artifacts_dir=str(art))
    app["args"]["limits"]["request_timeout_s"] = DEADLINE_S
    app["args"]["models"] = [{"name": "generate", "bundle": "bundles/generate",
                              "engine": {"max_slots": 8, "intra_op_threads": 1, "provider": "cpu"}}]
    gen = next(d for d in app["deployments"] if d["name"] == "generate")
    gen.update(num_replicas=2, max_replicas_per_node=1, health_check_period_s=2, graceful_shutdown_timeout_s=5,
               ray_actor_options={"num_cpus": 0.5})
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    ingress["ray_actor_options"] = {"num_cpus": 0, "resources": {"head": 0.01}}
    app["deployments"] = [ingress, gen]
    return cfg


async def load(base: str, kill: callable) -> list[dict]:
    sem, done, out = asyncio.Semaphore(CONCURRENCY), 0, []
    async with httpx.AsyncClient(base_url=base, timeout=DEADLINE_S + 10) as client:
        async def one(i: int) -> None:
            nonlocal done
            t0 = time.monotonic()
            async with sem:
                try:
                    if i % 4 == 0:
                        async with client.stream("POST", "/v1/generate", json={**BODY, "stream": True}) as r:
                            last = [line async for line in r.aiter_lines() if line.startswith("data: ")][-1:]
                        error = bool(last) and '"error"' in last[0]
                    else:
                        r = await client.post("/v1/generate", json=BODY)
                        error = False
                    out.append({"status": r.status_code, "s": time.monotonic() - t0, "stream_error": error,
                                "retry_after": r.headers.get("retry-after")})
                except httpx.HTTPError as e:
                    out.append({"status": None, "s": time.monotonic() - t0, "failure": repr(e)})
            done += 1
        tasks = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
        while done < REQUESTS // 4:
            await asyncio.sleep(0.01)
        kill()
        await asyncio.gather(*tasks)
    return out


def _replica_nodes() -> list[str]:
    """The node id of every live `generate` replica (Ray's state API)."""
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return sorted(a.node_id for a in actors if "generate" in (a.class_name or "") and "Replica" in a.class_name)


def main(art: Path) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from serving.server.config import validate_serve_config
    from serving.server.launch import start

    # The Python proxy here (Ray's default data plane: launch.start does not pick it for a Ray already running):
    # two nodes on one host would give two HAProxies the same HTTP, stats and metrics ports.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    second = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        start(validate_serve_config(config(art, port)), timeout_s=300)
        raylet = second.all_processes["raylet"][0].process.pid
        replica_nodes = _replica_nodes()
        killed = {}
        outcomes = asyncio.run(load(f"http://127.0.0.1:{port}", lambda: killed.update(
            at=time.monotonic(), pid=os.kill(raylet, signal.SIGKILL))))
        after = [httpx.post(f"http://127.0.0.1:{port}/v1/generate", json=BODY, timeout=30).status_code
                 for _ in range(10)]
        print("TWO_NODE " + json.dumps({"outcomes": outcomes, "after": after, "replica_nodes": replica_nodes,
                                        "killed_node": second.node_id}), flush=True)
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(Path(sys.argv[1])))
