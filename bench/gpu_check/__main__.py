"""`python -m bench.gpu_check --device cuda|cpu --out DIR`: every step of the gpu check, results to DIR.

Runs the steps in order (env, bundles, parity, kv_on_device, engine, gpu_tests, server; see __init__.py),
each one guarded: an exception or a missing prerequisite marks that step and the next one runs. After every
step DIR/gpu_check.json and DIR/gpu_check.md are written again, so a run cut short still leaves what it did.
Owns the order, the prerequisites of each step and the command line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.gpu_check import bundles as bundles_step
from bench.gpu_check import engine, env, gpu_tests, kv_on_device, parity, server
from bench.gpu_check.plan import PLANS, Plan, Step, run_step, skipped
from bench.gpu_check.report import document, markdown

STEPS = ("env", "bundles", "parity", "kv_on_device", "engine", "gpu_tests", "server")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Check:
    """One run: the device, plan, output folder, and the steps recorded so far."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.device, self.out, self.argv = args.device, args.out, argv
        self.plan: Plan = PLANS[args.device]
        self.artifacts = args.artifacts
        self.data_dir = args.data_dir or args.artifacts / "data"
        self.only = set(args.steps or STEPS) | {"env"}
        self.steps: list[Step] = []
        self.started = time.time()
        self.usable: dict[str, bool] = {}
        self.bundles = bundles_step.Bundles()

    def record(self, step: Step) -> None:
        self.steps.append(step)
        doc = document(self.device, asdict(self.plan), self.steps, self.started, self.argv)
        (self.out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(doc))

    def blocker(self, name: str) -> str | None:
        """Why step `name` cannot run (None: it can)."""
        needs = {"bundles": ("onnxruntime",), "parity": ("device", "torch", "bundles"), "kv_on_device": ("device", "bundles"),
                 "engine": ("device", "bundles"), "gpu_tests": ("device", "pytest", "torch"),
                 "server": ("device", "ray", "bundles")}[name]
        words = {"device": f"the {self.device} EP is not usable", "torch": "torch or another module of the bundle export is missing",
                 "ray": "ray or another module of the server step is missing", "pytest": "pytest is not importable",
                 "onnxruntime": "onnxruntime or a core module is missing", "bundles": "no bundles"}
        have = {**self.usable, "bundles": bool(self.bundles.paths)}
        missing = [words[n] for n in needs if not have.get(n)]
        return "; ".join(missing) or None

    def run(self) -> dict:
        self.record(run_step("env", lambda s: self.usable.update(env.run(s, self.device)), log))
        actions = {
            "bundles": lambda s: setattr(self, "bundles", bundles_step.run(s, self.plan, self.artifacts, self.out,
                                                                            self.usable.get("torch", False))),
            "parity": lambda s: parity.run(s, self.plan, self.bundles, self.device),
            "kv_on_device": lambda s: kv_on_device.run(s, self.plan, self.bundles, self.device, self.out / "kv"),
            "engine": lambda s: engine.run(s, self.plan, self.bundles, self.device),
            "gpu_tests": lambda s: gpu_tests.run(s, self.device, self.out),
            "server": lambda s: server.run(s, self.plan, self.bundles, self.device, self.out / "server", self.data_dir),
        }
        for name in STEPS[1:]:
            if name not in self.only:
                continue
            why = self.blocker(name)
            self.record(skipped(name, why) if why else run_step(name, actions[name], log))
        return document(self.device, asdict(self.plan), self.steps, self.started, self.argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=sorted(PLANS), required=True,
                   help="cuda: the CUDA EP (needs onnxruntime-gpu and a GPU); cpu: the same steps on the CPU EP")
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json, gpu_check.md and raw files")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"),
                   help="where trained checkpoints (ckpt/<task>) are looked for; none: the tiny preset")
    p.add_argument("--data-dir", type=Path, help="prepared data for the load test's prompts (default ARTIFACTS/data; "
                                                  "built-in sentences when absent)")
    p.add_argument("--steps", nargs="+", choices=STEPS, help="run only these steps (env always runs)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = Check(args, ["python -m bench.gpu_check", *argv]).run()
    log(f"[gpu-check] {args.out / 'gpu_check.md'}: exit status {doc['exit_status']}, checks "
        f"{sum(doc['checks'].values())}/{len(doc['checks'])} passed" + (f"; missing: {doc['missing']}" if doc['missing'] else ""))
    return doc["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
