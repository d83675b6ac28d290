"""Where `kvserve bench` finds what it measures: ARTIFACTS/bundles/<name>, ARTIFACTS/data, and the checkpoint a
bundle was exported from (checked to hold the very weights), with ARTIFACTS/bench for its own outputs.

Measures nothing; bench/cli.py exports what is missing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

WEIGHTS = "model.safetensors"  # a checkpoint's weights file (model/checkpoint.py)


@dataclass(frozen=True)
class Artifacts:
    root: Path
    work: Path

    def bundle(self, name: str) -> Path:
        return self.root / "bundles" / name

    @property
    def data(self) -> Path:
        return self.root / "data"

    def require_bundle(self, name: str) -> Path:
        b = self.bundle(name)
        if not (b / "manifest.json").is_file():
            raise FileNotFoundError(f"bundle {b} is missing (no manifest.json): export it first, e.g. "
                                    f"`make serve` or `kvserve export published/{name.split('-')[0]} --out {b}`")
        return b

    def checkpoint_of(self, bundle: Path) -> Path:
        """The checkpoint a bundle was exported from, checked to hold the very weights (sha256)."""
        from export.bundle import sha256_file  # torch-free (model.checkpoint would import torch)

        source = json.loads((bundle / "manifest.json").read_text())["source"]
        for ck in (Path(source["checkpoint"]), self.root / "ckpt" / bundle.name.split("-")[0]):
            if (ck / WEIGHTS).is_file() and sha256_file(ck / WEIGHTS) == source["weights_sha256"]:
                return ck
        raise FileNotFoundError(f"no checkpoint with the weights of bundle {bundle} (sha256 "
                                f"{source['weights_sha256'][:12]}...): looked at {source['checkpoint']} and "
                                f"{self.root}/ckpt/{bundle.name.split('-')[0]}; re-export the bundle from its checkpoint")

    def exported_from(self, bundle: Path, ckpt: Path) -> bool:
        """`bundle` exists and was exported from the weights in `ckpt`."""
        try:
            return (bundle / "manifest.json").is_file() and self.checkpoint_of(bundle).resolve() == ckpt.resolve()
        except FileNotFoundError:
            return False
