"""`kvserve serve`: the command line of serving/server/launch.py (start Ray Serve from existing bundles).

    kvserve serve [--config deploy/serve_config.yaml] [--artifacts DIR] [--host H] [--port 8000]
                  [--num-cpus N] [--dashboard] [--placement colocated|split]
    kvserve bundle-hash BUNDLE_DIR...    (each bundle's content hash, for a Serve config's `bundle_sha256`)

Owns only the arguments and their help; what the command does (validate the config, check the bundles,
start Ray and Serve, wait until RUNNING, drain and stop on Ctrl-C/SIGTERM) is launch.py's `serve_config`.
"""
from __future__ import annotations

import argparse

from serving.server.launch import DEFAULT_CONFIG, PLACEMENTS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve exported bundles with Ray Serve",
                              description="Start Ray Serve locally with the models of a Serve config file "
                                          "(default: deploy/serve_config.yaml); Ctrl-C stops it cleanly.")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="Ray Serve config file (default: %(default)s)")
    p.add_argument("--artifacts", help="artifacts directory holding bundles/ (overrides args.artifacts_dir)")
    p.add_argument("--host", help="HTTP host to bind (overrides http_options.host; default 127.0.0.1, this machine "
                                  "only); binding beyond loopback without an API key warns at start")
    p.add_argument("--port", type=int, help="HTTP port (overrides http_options.port)")
    p.add_argument("--num-cpus", dest="num_cpus", type=int,
                   help="logical CPUs for the local Ray instance (default: enough for the config's replicas)")
    p.add_argument("--dashboard", action="store_true", help="also start the Ray dashboard (port 8265)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="where the models run (default: as the config says; the shipped config colocates them): "
                        "colocated: every model in the ingress replica, no hop between the API and the engines "
                        "(models scale with the ingress); split: each model in a deployment of its own (models "
                        "scale on their own; one more process hop per request and per streamed chunk)")
    p.set_defaults(func=_cmd_serve)
    h = subparsers.add_parser("bundle-hash", help="print model bundles' content hashes (for bundle_sha256)",
                              description="Verify each bundle and print its content hash: the value of a model's "
                                          "`bundle_sha256` in the Serve config, which pins it (a replica refuses "
                                          "a bundle whose content differs).")
    h.add_argument("bundles", nargs="+", metavar="BUNDLE_DIR")
    h.set_defaults(func=_cmd_bundle_hash)


def _cmd_serve(args: argparse.Namespace) -> int:
    from serving.server.launch import serve_config

    return serve_config(args.config, artifacts=args.artifacts, host=args.host, port=args.port,
                        num_cpus=args.num_cpus, dashboard=args.dashboard, placement=args.placement)


def _cmd_bundle_hash(args: argparse.Namespace) -> int:
    from export.bundle import content_sha256, load_bundle

    for bundle_dir in args.bundles:
        print(f"{content_sha256(load_bundle(bundle_dir).manifest)}  {bundle_dir}")
    return 0
