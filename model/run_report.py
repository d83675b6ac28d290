"""What a finished training run leaves beside its checkpoint: `metrics.json` and `loss_curve.png`.

Owns the two files' contents. Does not own the checkpoint (model/train_state.py) nor the figures themselves
(model/train.py collects them in the run's history; model/validation.py computes the valid ones).
"""
from __future__ import annotations

import json
from pathlib import Path

METRICS, LOSS_CURVE = "metrics.json", "loss_curve.png"


def plot_curves(history: list[dict], path: Path) -> None:
    """Train loss over steps (left) and the valid figure of each validation, of the moving average too (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    tr = [h for h in history if "train_loss" in h]
    ax[0].plot([h["step"] for h in tr], [h["train_loss"] for h in tr], label="train loss (smoothed CE)")
    ax[0].set_xlabel("step"), ax[0].set_ylabel("loss"), ax[0].legend(), ax[0].grid(alpha=0.3)
    ev = [h for h in history if "eval" in h]
    key = "valid_chrf" if ev and "valid_chrf" in ev[0]["eval"] else "valid_bpc"
    ax[1].plot([h["step"] for h in ev], [h["eval"][key] for h in ev], marker="o", label=key)
    ema = [h for h in ev if "eval_ema" in h]
    if ema:
        ax[1].plot([h["step"] for h in ema], [h["eval_ema"][key] for h in ema], marker="x",
                   label=f"{key} (EMA weights)")
    ax[1].set_xlabel("step"), ax[1].legend(), ax[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(out: Path, metrics: dict) -> None:
    """metrics.json (the whole dict, history included) and the loss curve of its history, into `out`."""
    (out / METRICS).write_text(json.dumps(metrics, indent=2))
    plot_curves(metrics["history"], out / LOSS_CURVE)
