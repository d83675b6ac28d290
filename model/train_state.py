"""A training run between steps (`TrainRun`): how it starts, fresh or from train_state.pt, and how it is saved.

A fresh run trains its tokenizer on the train split and builds the preset's model from the seed, or with
`init` takes the tokenizer, the model shape and the weights of a checkpoint (a fine-tuning run); a resumed
run (--resume) loads the tokenizer, the model config, the weights, the optimizer, torch's RNG state, the step,
the elapsed time, the history and the moving average, so that it continues exactly where it stopped. Each
save writes a checkpoint (model/checkpoint.py layout) with the train state beside it.

Owns the train state's contents. Does not own the checkpoint's file format (model/checkpoint.py) nor when a
run is saved (model/train.py).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from model import data as data_mod
from model.checkpoint import (
    TOKENIZER,
    Checkpoint,
    load_checkpoint,
    load_model_config,
    load_train_state,
    save_checkpoint,
)
from model.config import ModelConfig, preset
from model.precision import Bf16Twin
from model.provenance import git_commit, machine, package_versions
from model.step import make_optimizer
from model.tokenizer import Tokenizer
from model.train_config import TrainConfig
from model.transformer import build_model, count_parameters
from model.weight_average import WeightAverage


@dataclass
class TrainRun:
    """What a run carries from step to step: what `save_run` writes and `start_run` restores."""
    cfg: TrainConfig
    out: Path
    tok: Tokenizer
    model_config: ModelConfig
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    avg: WeightAverage | None = None  # the moving average of the weights, when cfg.ema > 0
    step: int = 0  # optimizer steps taken
    elapsed: float = 0.0  # seconds of training, over all resumes
    history: list[dict] = field(default_factory=list)  # train losses and validations, as in metrics.json
    weights: str | None = None  # which weights are kept, "last" or "ema", once chosen at the end
    twin: Bf16Twin | None = None  # the bf16 twin that computes the steps, when cfg.precision is "bf16"
    starts: list[dict] = field(default_factory=list)  # each (re)start: its step, commit, machine, library versions
    init: dict = field(default_factory=dict)  # the checkpoint a fine-tuning run started from (`init_record`)

    def set_precision(self, precision: str) -> None:
        """Train in `precision` from now on (not "auto": model/step.py choose_precision resolves that)."""
        self.cfg = dataclasses.replace(self.cfg, precision=precision)
        self.twin = Bf16Twin(self.model) if precision == "bf16" else None


def train_tokenizer(cfg: TrainConfig, out: Path) -> Tokenizer:
    """A BPE tokenizer of cfg.vocab_size trained on the train split, saved into the checkpoint directory."""
    if cfg.task == "translate":
        pairs = data_mod.load_pairs(cfg.data_dir, "train")
        texts = [s for pair in pairs for s in pair]
    else:
        texts = data_mod.load_text(cfg.data_dir, "train").split("\n")
    tok = Tokenizer.train(texts, cfg.vocab_size)
    tok.save(out / TOKENIZER)
    return tok


def start_run(cfg: TrainConfig, resume: bool = False) -> TrainRun:
    """A fresh run in cfg.out, or with `resume` the one saved there (FileNotFoundError when there is none)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state = load_train_state(out) if resume else None
    if resume and state is None:
        raise FileNotFoundError(f"--resume: no train_state.pt in {out}")
    init = None if state or not cfg.init else load_checkpoint(cfg.init)
    if init is not None and init.task != cfg.task:
        raise ValueError(f"--init {cfg.init} is a {init.task} checkpoint, not {cfg.task}")
    if state:
        tok = Tokenizer.load(out / TOKENIZER)
    elif init is not None:
        tok = init.tokenizer
        shutil.copyfile(init.path / TOKENIZER, out / TOKENIZER)
    else:
        tok = train_tokenizer(cfg, out)
    # A resumed run keeps the model it was started with, also when the preset has changed since.
    saved = load_model_config(out) if state else None
    model_config = saved or (init.config if init else preset(cfg.preset, cfg.task, tok.vocab_size, tok.pad_id))
    torch.manual_seed(cfg.seed)
    model = build_model(model_config)
    if init is not None:
        model.load_state_dict({k: v.float() for k, v in init.model.state_dict().items()})
        model.train()
    run = TrainRun(cfg, out, tok, model_config, model, make_optimizer(model, cfg))
    if init is not None:
        run.init = init_record(init)
    if state:
        restore_train_state(run, state)
    if cfg.ema:
        run.avg = WeightAverage(model, cfg.ema, state.get("ema") if state else None)
    run.starts.append({"step": run.step, "commit": git_commit(), "machine": machine(),
                       "versions": package_versions()})
    return run


def init_record(init: Checkpoint) -> dict:
    """What a fine-tuning run records of the checkpoint it started from: its weights' sha256 and its own run
    (recipe, steps, time, starts, validation), so that the published model's manifest names both runs."""
    keep = ("train_config", "step", "elapsed_s", "weights", "metrics", "starts", "init")
    return {"weights_sha256": init.weights_sha256(), **{k: init.meta[k] for k in keep if k in init.meta}}


def restore_train_state(run: TrainRun, state: dict) -> None:
    """Put a saved train state (`train_state`'s dict) back into the run's model, optimizer and torch's RNG."""
    run.model.load_state_dict(state["model"])
    run.opt.load_state_dict(state["optimizer"])
    for g in run.opt.param_groups:  # a state of an unfused AdamW would turn fusing off
        g["fused"] = True
    torch.set_rng_state(state["torch_rng"])
    run.step, run.elapsed = int(state["step"]), float(state["elapsed"])
    if "precision" in state:  # a resumed run keeps the precision it chose
        run.set_precision(state["precision"])
    run.history = json.loads(state["history"])
    run.starts = json.loads(state.get("starts", "[]"))
    run.init = json.loads(state.get("init", "{}"))


def train_state(run: TrainRun) -> dict:
    """The run as it is in training (the last weights in the model, the average beside them), for --resume."""
    state = {"model": copy.deepcopy(run.model.state_dict()), "optimizer": run.opt.state_dict(),  # tied stay one
             "torch_rng": torch.get_rng_state(), "step": run.step, "elapsed": run.elapsed,
             "history": json.dumps(run.history), "precision": run.cfg.precision, "starts": json.dumps(run.starts),
             "init": json.dumps(run.init)}
    if run.avg:
        state["ema"] = copy.deepcopy(run.avg.shadow)
    return state


def save_run(run: TrainRun, metrics: dict | None = None) -> None:
    """A checkpoint of the kept weights (the average once it is chosen) with the train state as in training
    beside it, so that --resume continues the run exactly also after the average was kept."""
    state = train_state(run)
    meta = {"train_config": asdict(run.cfg), "parameters": count_parameters(run.model), "starts": run.starts}
    if run.weights:
        meta["weights"] = run.weights
    if run.init:
        meta["init"] = run.init
    meta.update(step=run.step, elapsed_s=round(run.elapsed, 1), metrics=metrics or {})
    use_average = run.weights == "ema"
    if use_average:
        run.avg.swap()
    try:
        save_checkpoint(run.out, run.model, run.model_config, run.cfg.task, run.out / TOKENIZER, meta, state)
    finally:
        if use_average:
            run.avg.swap()
