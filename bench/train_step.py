"""Time one training step of a preset, A/B: the project's CPU dropout vs torch's nn.Dropout (bernoulli_),
fused vs per-parameter AdamW, dropout on the attention weights and ReLU outputs (as `dropout`) vs none
(as the small translation preset has it), and the fused label-smoothed loss (model/loss.py) vs torch's
cross_entropy. The variants alternate in one process (medians over rounds), so the machine's noise hits
them alike; compare the ratios.

    python -m bench.train_step --preset small --task translate --pairs 90 --threads 2

Owns the measurement only. The step and optimizer are model/step.py's (`train_step`, `make_optimizer`), with
the recipe's bf16 autocast and label smoothing (model/train_config.py), on random token ids; the attention
dropout inside scaled_dot_product_attention is torch's wherever it is on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from model.config import preset
from model.cpu_memory import keep_freed_memory
from model.loss import smoothed_cross_entropy, torch_cross_entropy
from model.step import make_optimizer, train_step
from model.train_config import recipe
from model.transformer import Dropout, build_model

VARIANTS = {  # name: (project dropout, fused AdamW, dropout on attention weights and ReLU outputs, fused loss)
    "torch dropout, AdamW": (False, False, True, False),
    "project dropout, AdamW": (True, False, True, False),
    "project dropout, fused AdamW": (True, True, True, False),
    "project dropout, fused AdamW, none on attention/ReLU": (True, True, False, False),
    "project dropout, fused AdamW, none on attention/ReLU, fused loss": (True, True, False, True),
}


def _model(task: str, preset_name: str, vocab: int, project_dropout: bool, inner: bool,
           dropout: float | None) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = preset(preset_name, task, vocab, 0)
    cfg = cfg if dropout is None else cfg.replace(dropout=dropout)
    inner_p = cfg.dropout if inner else 0.0
    model = build_model(cfg.replace(attention_dropout=inner_p, activation_dropout=inner_p)).train()
    if not project_dropout:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Dropout):
                    setattr(module, name, torch.nn.Dropout(child.p))
    return model


def bench(task: str = "translate", preset_name: str = "small", pairs: int = 90, tokens: int = 16,
          vocab: int = 8000, rounds: int = 6, steps: int = 3, dropout: float | None = None) -> dict:
    """Median ms per training step of each variant on random batches of `pairs` x `tokens` (+1 target);
    `dropout` overrides the preset's (tiny has none)."""
    cfg = recipe(task)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (pairs, tokens), generator=g)
    tin, tout = (torch.randint(4, vocab, (pairs, tokens + 1), generator=g) for _ in range(2))
    batch = (src, torch.full((pairs,), tokens), tin, tout) if task == "translate" else (tin, tout)
    runs = {}
    for name, (project, fused, inner, fused_loss) in VARIANTS.items():
        model = _model(task, preset_name, vocab, project, inner, dropout)
        criterion = smoothed_cross_entropy if fused_loss else torch_cross_entropy
        runs[name] = (model, make_optimizer(model, cfg, fused=fused), criterion)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, opt, criterion) in runs.items():
            train_step(model, opt, batch, cfg, 0, criterion)  # warm-up of this variant after the others ran
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(model, opt, batch, cfg, 0, criterion)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = med["torch dropout, AdamW"]
    return {"models": {name: model for name, (model, _, _) in runs.items()}, "task": task, "preset": preset_name,
            "pairs": pairs, "tokens": tokens, "threads": torch.get_num_threads(), "rounds": rounds,
            "step_ms": {k: round(v, 1) for k, v in med.items()},
            "speedup_vs_torch_dropout": {k: round(base / v, 2) for k, v in med.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["translate", "generate"], default="translate")
    p.add_argument("--preset", default="small")
    p.add_argument("--pairs", type=int, default=90, help="rows per batch")
    p.add_argument("--tokens", type=int, default=16, help="source tokens per row (targets get one more)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="leave glibc's malloc as it is (training keeps freed memory: model/cpu_memory.py); "
                        "run once with and once without to compare, it is a setting of the whole process")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = False if args.malloc_defaults else keep_freed_memory()
    result = bench(args.task, args.preset, args.pairs, args.tokens, args.vocab, args.rounds, args.steps)
    result.pop("models")
    result["keep_freed_memory"] = kept
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
