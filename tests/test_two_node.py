"""A real two-node Ray cluster on this machine: kill -9 of the second node's raylet under 200 requests (slow).

The scenario runs in its own process with its own cluster (tests/two_node_cluster.py). Every request is
answered -- a 200, or a 503 that says to retry (with Retry-After), or for a stream already answering an
`unavailable` error event -- none hangs past its deadline, and the model serves afterwards on the head node.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from conftest import own_ray_env
from two_node_cluster import DEADLINE_S, REQUESTS

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_killing_the_second_nodes_raylet_loses_no_request(bundles):
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "two_node_cluster.py"), str(bundles)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=own_ray_env())
    line = next((x for x in run.stdout.splitlines() if x.startswith("TWO_NODE ")), None)
    assert line is not None, (run.stdout[-2000:], run.stderr[-4000:])
    result = json.loads(line[len("TWO_NODE "):])
    outcomes = result["outcomes"]
    statuses = Counter(o["status"] for o in outcomes)
    print(f"two-node cluster, raylet of node 2 killed under {REQUESTS} requests: statuses {dict(statuses)}, "
          f"streams ended by an error event {sum(o.get('stream_error', False) for o in outcomes)}, "
          f"slowest {max(o['s'] for o in outcomes):.1f}s, afterwards {Counter(result['after'])}")
    assert len(set(result["replica_nodes"])) == 2 and result["killed_node"] in result["replica_nodes"], result
    assert len(outcomes) == REQUESTS and set(statuses) <= {200, 503}, statuses
    assert all(o.get("retry_after") for o in outcomes if o["status"] == 503)
    assert max(o["s"] for o in outcomes) <= DEADLINE_S + 3
    assert result["after"] == [200] * 10
