"""Parity of a bundle against the PyTorch checkpoint it was exported from, on the test split; prints JSON.

    python -m kvserve.parity BUNDLE CHECKPOINT --sentences 200 [--provider cuda]

The command line of export/parity.py `real_parity` (lockstep logits, identical greedy outputs, quality
delta), with the bundle run by serving's ONNX Runtime (kvserve/runtime.py). Needs torch.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from export.evaluate import DEFAULT_DATA_DIR


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvserve.parity",
                                description="Parity of a bundle against its PyTorch checkpoint on the test split; "
                                            "prints JSON.")
    p.add_argument("bundle", type=Path, help="bundle directory (kvserve export --out)")
    p.add_argument("checkpoint", type=Path, help="checkpoint directory the bundle was exported from")
    p.add_argument("--sentences", type=int, default=200, help="test sentences (translation) or prompts (LM)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="data directory of `kvserve data`")
    p.add_argument("--steps", type=int, default=20, help="lockstep decode steps per row")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--provider", default="auto", help="auto, cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default 1)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.sentences < 1 or a.batch_size < 1 or a.steps < 1:
        p.error(f"--sentences, --batch-size and --steps must be >= 1 (got {a.sentences}, {a.batch_size}, {a.steps})")
    import torch

    from export.parity import real_parity
    from kvserve.runtime import ort_runtime

    torch.set_num_threads(a.threads or 1)
    result = real_parity(a.bundle, a.checkpoint, a.sentences, a.data_dir, ort_runtime(a.provider, a.threads),
                         a.batch_size, a.steps)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
