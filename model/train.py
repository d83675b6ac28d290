"""Training: `kvserve train --task translate|generate --preset P --out DIR` calls `train(recipe(task, ...))`.

The loop, step by step: set the LR (model/schedule.py), take the step's batch (model/batching.py), update the
weights (model/step.py) and their moving average (model/weight_average.py); every `eval_every` steps validate
(model/validation.py) and save (model/train_state.py). The run stops at `steps`, at --stop-at or when the
time budget runs out, validates on the whole valid split, keeps the better of the last weights and their
average, and leaves `metrics.json` and `loss_curve.png` beside the checkpoint (model/run_report.py).

Same seed, same result: the batch of a step depends on the step only, torch's RNG state (dropout) is saved
with the train state, and the schedule depends on steps only unless the run has a time budget. --resume
continues a run exactly.

Owns the order of these parts and when to validate, save and stop. The settings and default recipes are
model/train_config.py's (`TrainConfig` and `recipe` are importable from here too).
"""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from model.batching import Batcher
from model.cpu_memory import keep_freed_memory
from model.run_report import write_report
from model.schedule import set_lr
from model.step import choose_precision, train_step
from model.train_config import TrainConfig, recipe
from model.train_state import TrainRun, save_run, start_run
from model.transformer import count_parameters
from model.validation import better, validate, validate_average

__all__ = ["TrainConfig", "recipe", "train"]

LOG_EVERY = 25  # steps per train-loss entry in the history (the mean over those steps' tokens)
PACE_STEPS = (5, 30)  # the speed is measured between these steps of a (re)start: after the first steps' one-time costs


def train(cfg: TrainConfig, resume: bool = False) -> dict:
    """Train the run `cfg` describes (with `resume`, continue the one saved in cfg.out); returns its metrics,
    also written to metrics.json."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_freed_memory()  # the same large tensors every step: no page faults for them after the first
    run = start_run(cfg, resume)
    batcher = Batcher(cfg, run.tok, run.model_config.max_len)
    resolve_precision(run, batcher)
    print(f"{cfg.task}/{cfg.preset}: {count_parameters(run.model) / 1e6:.2f}M parameters, vocab "
          f"{run.tok.vocab_size}, steps {run.step}->{cfg.steps}, precision {run.cfg.precision}", file=sys.stderr)
    run_steps(run, batcher)
    return finish(run)


def resolve_precision(run: TrainRun, batcher: Batcher) -> None:
    """Set the run's precision; "auto" is measured on the run's next batch (model/step.py choose_precision)."""
    if run.cfg.precision != "auto":
        run.set_precision(run.cfg.precision)
        return
    chosen, ms = choose_precision(run.model, batcher.batch(run.step), run.cfg, run.tok.pad_id)
    times = ", ".join(f"{name} {v:.0f} ms" for name, v in ms.items()) if len(ms) > 1 else "no native bf16"
    print(f"precision auto -> {chosen} (a step: {times})", file=sys.stderr)
    run.set_precision(chosen)


def run_steps(run: TrainRun, batcher: Batcher) -> None:
    """Train from run.step until the last step (`steps`, --stop-at or the time budget); validate and save every
    eval_every steps, and save after the last."""
    cfg = run.cfg
    run.model.train()
    t0, elapsed0 = time.time(), run.elapsed
    bar = tqdm(total=cfg.steps, initial=run.step, desc=f"train {cfg.task}", unit="step", file=sys.stderr,
               mininterval=2.0)
    loss_sum, n_tokens = 0.0, 0
    first, pace_t0 = run.step, None
    while run.step < cfg.steps:
        lr = set_lr(run.opt, run.step, run.elapsed, cfg)
        loss, ntok = train_step(run.model, run.opt, batcher.batch(run.step), cfg, run.tok.pad_id, twin=run.twin)
        if run.avg:
            run.avg.update(run.step)
        run.step += 1
        run.elapsed = elapsed0 + time.time() - t0
        loss_sum, n_tokens = loss_sum + loss.item() * ntok, n_tokens + ntok
        bar.update(1)
        if run.step - first == PACE_STEPS[0]:
            pace_t0 = time.time()
        elif run.step - first == PACE_STEPS[1]:
            bar.write(pace_line(cfg, run.step, (PACE_STEPS[1] - PACE_STEPS[0]) / (time.time() - pace_t0)))
        if run.step % LOG_EVERY == 0:
            run.history.append({"step": run.step, "train_loss": round(loss_sum / n_tokens, 4),
                                "elapsed_s": round(run.elapsed, 1)})
            bar.set_postfix(loss=f"{loss_sum / n_tokens:.3f}", lr=f"{lr:.2e}")
            loss_sum, n_tokens = 0.0, 0
        last = is_last_step(run)
        if run.step % cfg.eval_every == 0 and not last:  # the last step gets the full validation in finish()
            validate_on_the_way(run, bar)
            save_run(run)
        if last:
            if run.step < cfg.steps:
                bar.write(f"stopping at step {run.step} (time budget or --stop-at)")
            save_run(run)  # an interrupt during the final validation loses nothing
            break
    bar.close()


def pace_line(cfg: TrainConfig, step: int, steps_per_s: float) -> str:
    """What the rest of the run will take on this machine at the measured speed, and how to shorten it."""
    left_s = (cfg.steps - step) / steps_per_s
    line = (f"{cfg.task}: {steps_per_s:.2f} steps/s on this machine: the remaining {cfg.steps - step:,} of "
            f"{cfg.steps:,} steps take ~{left_s / 60:.0f} min (plus validation every {cfg.eval_every:,} steps)")
    if cfg.time_budget_s:
        return line + f"; the time budget ends the run after {cfg.time_budget_s / 60:.0f} min of training"
    return line + "; `--time-budget SECONDS` ends it sooner, with a lower quality"


def is_last_step(run: TrainRun) -> bool:
    """The run has reached `steps`, --stop-at or the end of its time budget."""
    cfg = run.cfg
    out_of_time = bool(cfg.time_budget_s and run.elapsed >= cfg.time_budget_s)
    return run.step == cfg.steps or run.step == cfg.stop_at or out_of_time


def validate_on_the_way(run: TrainRun, bar: tqdm) -> None:
    """Validate the weights (and their average) on the first eval_sentences; the figures go to the history."""
    max_len = run.model_config.max_len
    entry = {"step": run.step, "eval": validate(run.model, run.tok, run.cfg, max_len),
             "elapsed_s": round(run.elapsed, 1)}
    run.history.append(entry)
    if run.avg:
        entry["eval_ema"] = validate_average(run.avg, run.model, run.tok, run.cfg, max_len)
    bar.write(f"step {run.step}: {entry['eval']} ema {entry.get('eval_ema')} ({run.elapsed:.0f}s)")


def finish(run: TrainRun) -> dict:
    """Validate on the whole valid split, keep the better of the last weights and their average, save, and
    write metrics.json and loss_curve.png; returns the metrics."""
    cfg, max_len = run.cfg, run.model_config.max_len
    final = validate(run.model, run.tok, cfg, max_len, final=True)
    run.history.append({"step": run.step, "eval": final, "elapsed_s": round(run.elapsed, 1)})
    run.weights = "last"
    if run.avg:
        final_ema = validate_average(run.avg, run.model, run.tok, cfg, max_len, final=True)
        run.history[-1]["eval_ema"] = final_ema
        if better(final_ema, final):  # chosen on the valid split; the test split stays unseen
            final, run.weights = final_ema, "ema"
    save_run(run, final)
    metrics = {"task": cfg.task, "preset": cfg.preset, "steps": run.step, "train_seconds": round(run.elapsed, 1),
               "steps_per_s": round(run.step / max(run.elapsed, 1e-9), 3), "precision": cfg.precision,
               "parameters": count_parameters(run.model), "weights": run.weights, "final": final,
               "history": run.history}
    write_report(run.out, metrics)
    return metrics
