"""The settings of a training run (`TrainConfig`) and the default run of each task (`RECIPES`, `recipe`).

Owns what a run does: its data, batch sizes, optimizer, schedule, validation and stopping rules. Does not own
the model's shape (model/config.py presets) nor how the settings are used (model/train.py and the modules it
calls); `kvserve train` turns its flags into `recipe(task, **overrides)` (kvserve/cli.py).
"""
from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16-autocast", "bf16", "auto")  # model/precision.py says what each does


@dataclass(frozen=True)
class TrainConfig:
    task: str = "translate"  # "translate" (encoder-decoder on pairs) or "generate" (decoder-only LM on text)
    preset: str = "small"  # the model's shape, a name in model/config.py PRESETS
    out: str = "artifacts/ckpt/translate"  # the checkpoint directory (also holds train_state.pt for --resume)
    data_dir: str = "artifacts/data"  # what `kvserve data` wrote
    steps: int = 2000  # the LR schedule spans this many steps
    time_budget_s: float = 0.0  # > 0: stop (and save) when the wall clock runs out; the LR decay follows the clock
    batch_tokens: int = 4000  # translation: padded source+target tokens per batch
    lm_batch: int = 24  # LM: windows per batch
    lm_window: int = 128  # LM: tokens per window (after bos)
    lr: float = 1e-3  # the peak learning rate, reached at the end of warmup (model/schedule.py)
    warmup: int = 200  # steps of linear warmup; then a cosine decay to a floor by `steps`
    weight_decay: float = 0.01  # AdamW's, on weight matrices and embeddings only
    label_smoothing: float = 0.1
    clip: float = 1.0  # the gradient norm is clipped to this
    vocab_size: int = 4000  # the BPE tokenizer trained on the train split at the start of a run
    eval_every: int = 250  # validate (and save) every this many steps
    eval_sentences: int = 200  # translation: greedy chrF on this many valid sentences at each eval
    seed: int = 1234  # model initialisation, batch order and dropout
    threads: int = 0  # 0 = torch default
    stop_at: int = 0  # > 0: stop (and save) after this step, keeping the schedule of `steps` (for --resume)
    precision: str = "fp32"  # "fp32", "bf16-autocast", "bf16" (a bf16 twin, fp32 master weights) or "auto"
    # (bf16 autocast where the CPU has it natively and fp32 is not clearly faster at the start): model/precision.py
    ema: float = 0.0  # > 0: also keep an exponential moving average of the weights; the better on valid is kept
    init: str = ""  # a checkpoint directory: start from its weights, model shape and tokenizer (fine-tuning)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; choose one of {list(PRECISIONS)}")


# The runs that made the published models (published/<task>/manifest.json), and what `make train` reruns: both side
# by side on one thread each. The length is a number of optimizer steps and the precision is pinned, so the same
# seed gives the same weights on the same machine kind; `--time-budget` trades quality for time. Weight decay: the
# translator's 0.2 from a sweep of 0.01/0.1/0.3/1.0 (docs/decisions/translator-regularisation.md); the LM's 0.1
# for its longer run.
RECIPES: dict[str, dict] = {
    "translate": dict(task="translate", preset="small", out="artifacts/ckpt/translate", steps=12000,
                      batch_tokens=3000, lr=2e-3, warmup=400, weight_decay=0.2, vocab_size=8000, eval_every=1000,
                      precision="bf16-autocast", ema=0.999),
    # The LM trains on windows of its whole context (255 tokens after bos), as it is evaluated and served: on
    # 128-token windows positions 128-255 were never trained (docs/decisions/lm-training-windows.md).
    "generate": dict(task="generate", preset="small", out="artifacts/ckpt/generate", steps=5000, lm_batch=12,
                     lm_window=255, lr=1.5e-3, warmup=200, weight_decay=0.1, vocab_size=4000, eval_every=500,
                     precision="bf16-autocast", ema=0.999),
}

# The published translator is the translate recipe's model fine-tuned on the train split plus that model's own
# beam-4 translations of the train sources (sequence-level distillation, `kvserve distill`): greedy decoding then
# gets most of what the recipe's model needed a beam for (docs/decisions/distillation.md). `make train` runs it
# after the recipe (kvserve/up.py distill_translator), on one thread like the recipe, so that the weights repeat.
DISTILLATION: dict = dict(beam_size=4, steps=4000, lr=5e-4, warmup=200)


def recipe(task: str, **overrides) -> TrainConfig:
    """The default training run for a task, with explicit overrides (e.g. from the command line)."""
    if task not in RECIPES:
        raise ValueError(f"unknown task {task!r}; choose one of {sorted(RECIPES)}")
    cfg = {**RECIPES[task], **overrides}
    if "out" not in overrides and cfg.get("preset") != RECIPES[task]["preset"]:
        cfg["out"] = f"artifacts/ckpt/{task}-{cfg['preset']}"
    return TrainConfig(**cfg)
