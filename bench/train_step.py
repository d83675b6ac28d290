"""Time one training step of a preset, A/B: the project's CPU dropout vs torch's nn.Dropout (bernoulli_),
fused vs per-parameter AdamW, dropout on the attention weights and ReLU outputs (as `dropout`) vs none
(as the small translation preset has it), the fused label-smoothed loss (model/loss.py) vs torch's
cross_entropy, and the precisions (model/precision.py): bf16 autocast, the bf16 twin with fp32 master weights,
fp32. The variants alternate in one process (medians over rounds), so the machine's noise hits them alike;
compare the ratios. --variants picks some by number (all by default).

    python -m bench.train_step --preset small --task translate --pairs 90 --threads 2 --variants 5,6,7

Owns the measurement only. The step and optimizer are model/step.py's (`train_step`, `make_optimizer`), with
the recipe's label smoothing (model/train_config.py), on random token ids; the attention dropout inside
scaled_dot_product_attention is torch's wherever it is on.
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
from model.precision import Bf16Twin
from model.step import make_optimizer, train_step
from model.train_config import recipe
from model.transformer import Dropout, build_model

VARIANTS = {  # name: (project dropout, fused AdamW, dropout on attention weights and ReLU outputs, fused loss,
    # precision); numbered from 1 in this order for --variants
    "torch dropout, AdamW": (False, False, True, False, "bf16-autocast"),
    "project dropout, AdamW": (True, False, True, False, "bf16-autocast"),
    "project dropout, fused AdamW": (True, True, True, False, "bf16-autocast"),
    "project dropout, fused AdamW, none on attention/ReLU": (True, True, False, False, "bf16-autocast"),
    "project dropout, fused AdamW, none on attention/ReLU, fused loss": (True, True, False, True, "bf16-autocast"),
    "as 5, bf16 twin with fp32 master weights": (True, True, False, True, "bf16"),
    "as 5, fp32": (True, True, False, True, "fp32"),
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
          vocab: int = 8000, rounds: int = 6, steps: int = 3, dropout: float | None = None,
          variants: list[str] | None = None) -> dict:
    """Median ms per training step of each variant (all, or the names in `variants`) on random batches of
    `pairs` x `tokens` (+1 target); `dropout` overrides the preset's (tiny has none)."""
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (pairs, tokens), generator=g)
    tin, tout = (torch.randint(4, vocab, (pairs, tokens + 1), generator=g) for _ in range(2))
    batch = (src, torch.full((pairs,), tokens), tin, tout) if task == "translate" else (tin, tout)
    runs = {}
    for name in variants or list(VARIANTS):
        project, fused, inner, fused_loss, precision = VARIANTS[name]
        model = _model(task, preset_name, vocab, project, inner, dropout)
        criterion = smoothed_cross_entropy if fused_loss else torch_cross_entropy
        twin = Bf16Twin(model) if precision == "bf16" else None
        runs[name] = (model, make_optimizer(model, recipe(task), fused=fused), criterion,
                      recipe(task, precision=precision), twin)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (model, opt, criterion, cfg, twin) in runs.items():
            train_step(model, opt, batch, cfg, 0, criterion, twin)  # warm-up of this variant after the others ran
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(model, opt, batch, cfg, 0, criterion, twin)
            times[name].append((time.perf_counter() - t0) / steps * 1e3)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = next(iter(med.values()))
    return {"models": {name: run[0] for name, run in runs.items()}, "runs": runs, "task": task, "preset": preset_name,
            "pairs": pairs, "tokens": tokens, "threads": torch.get_num_threads(), "rounds": rounds,
            "step_ms": {k: round(v, 1) for k, v in med.items()},
            "speedup_vs_first": {k: round(base / v, 2) for k, v in med.items()},
            "all_ms": {k: [round(x, 1) for x in v] for k, v in times.items()}}


def profile(result: dict, task: str, pairs: int, tokens: int, vocab: int, steps: int = 5, top: int = 8) -> dict:
    """torch.profiler over `steps` steps of each variant `bench` built: the ops with the most self CPU time, each
    with its share of the total, its calls per step and its mean time per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    g = torch.Generator().manual_seed(1)
    tin, tout = (torch.randint(4, vocab, (pairs, tokens + 1), generator=g) for _ in range(2))
    src = torch.randint(4, vocab, (pairs, tokens), generator=g)
    batch = (src, torch.full((pairs,), tokens), tin, tout) if task == "translate" else (tin, tout)
    tables = {}
    for name, (model, opt, criterion, cfg, twin) in result["runs"].items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                train_step(model, opt, batch, cfg, 0, criterion, twin)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops)
        tables[name] = [{"op": e.key, "self_pct": round(100 * e.self_cpu_time_total / total, 1),
                         "calls_per_step": round(e.count / steps), "us_per_call": round(e.self_cpu_time_total / e.count)}
                        for e in ops[:top]]
        tables[name].append({"op": "(total self CPU per step)", "ms": round(total / steps / 1e3, 1)})
    return tables


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
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="then profile this many steps of each variant (torch.profiler): the ops with the most time")
    p.add_argument("--variants", help="comma-separated numbers of the variants to time (1-%d; default all): %s" % (
        len(VARIANTS), "; ".join(f"{i} {n}" for i, n in enumerate(VARIANTS, 1))))
    p.add_argument("--malloc-defaults", action="store_true",
                   help="leave glibc's malloc as it is (training keeps freed memory: model/cpu_memory.py); "
                        "run once with and once without to compare, it is a setting of the whole process")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = False if args.malloc_defaults else keep_freed_memory()
    names = list(VARIANTS)
    chosen = [names[int(i) - 1] for i in args.variants.split(",")] if args.variants else None
    result = bench(args.task, args.preset, args.pairs, args.tokens, args.vocab, args.rounds, args.steps,
                   variants=chosen)
    if args.profile:
        result["profile"] = profile(result, args.task, args.pairs, args.tokens, args.vocab, args.profile)
    result.pop("models"), result.pop("runs")
    result["keep_freed_memory"] = kept
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
