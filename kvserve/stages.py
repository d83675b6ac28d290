"""A kvserve subcommand run as one stage of a longer job (`kvserve up --train`, `kvserve back-translate`): in a
child process of the same interpreter, announced and timed on stderr."""
from __future__ import annotations

import subprocess
import sys
import time


def kvserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvserve.cli", *args]


def run_stage(cmd: list[str], what: str, check: bool = True) -> int:
    print(f"==> {what}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, check=check).returncode
    print(f"==> {what}: done in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    return rc
