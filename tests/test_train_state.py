"""The parts of a run between steps: train state saved and restored (model/train_state.py), validation with the
moving average (model/validation.py), and the report beside the checkpoint (model/run_report.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from model import data
from model.batching import Batcher
from model.run_report import write_report
from model.step import train_step
from model.train_config import TrainConfig
from model.train_state import TrainRun, save_run, start_run
from model.validation import better, validate, validate_average


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [f"The {w} is big {i}.\tDas {g} ist groß {i}." for i in range(40)
            for w, g in (("house", "Haus"), ("dog", "Hund"), ("cat", "Katze"))]
    (d / "pairs.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    data.prepare_translation(d, tsv=d / "pairs.tsv")
    return d


def config(tmp_path, data_dir, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(task="translate", preset="tiny", out=str(tmp_path / "run"), data_dir=str(data_dir),
                                 vocab_size=300, batch_tokens=300, eval_sentences=6, seed=5, ema=0.5), **kw})


def take_steps(run: TrainRun, n: int) -> None:
    """What model/train.py's loop does to a run, without its schedule and saving."""
    batcher = Batcher(run.cfg, run.tok, run.model_config.max_len)
    run.model.train()
    for _ in range(n):
        train_step(run.model, run.opt, batcher.batch(run.step), run.cfg, run.tok.pad_id)
        run.avg.update(run.step)
        run.step += 1
        run.elapsed += 1.5
        run.history.append({"step": run.step, "train_loss": 1.0})


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_resumed_run_has_everything_the_saved_run_had(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match="--resume: no train_state.pt in"):
        start_run(config(tmp_path, data_dir), resume=True)
    run = start_run(config(tmp_path, data_dir))
    assert (run.step, run.history, run.weights) == (0, [], None) and run.tok.vocab_size <= 300
    take_steps(run, 3)
    torch.manual_seed(99)  # the RNG state (dropout) at the save is part of the train state
    save_run(run)
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    back = start_run(config(tmp_path, data_dir), resume=True)
    assert torch.equal(torch.get_rng_state(), rng)
    assert (back.step, back.elapsed, back.history) == (3, 4.5, run.history)
    assert back.model_config == run.model_config and back.tok.vocab_size == run.tok.vocab_size
    assert same(back.model.state_dict(), run.model.state_dict())
    assert same(back.opt.state_dict(), run.opt.state_dict()) and back.opt.state_dict()["state"]  # AdamW moments
    assert same(back.avg.shadow, run.avg.shadow) and not same(back.avg.shadow, list(back.model.parameters()))
    assert all(g["fused"] for g in back.opt.param_groups)
    meta = json.loads((tmp_path / "run" / "checkpoint.json").read_text())
    assert meta["step"] == 3 and meta["elapsed_s"] == 4.5 and meta["train_config"]["seed"] == 5
    assert "weights" not in meta and meta["metrics"] == {}


def test_keeping_the_average_saves_it_as_the_weights_and_the_last_weights_as_the_train_state(tmp_path, data_dir):
    run = start_run(config(tmp_path, data_dir))
    take_steps(run, 3)
    last = {k: v.clone() for k, v in run.model.state_dict().items()}
    run.weights = "ema"
    save_run(run, {"valid_chrf": 1.0})
    out = tmp_path / "run"
    saved = load_file(str(out / "model.safetensors"))
    names = [k for k, _ in run.model.named_parameters()]
    assert all(torch.equal(saved[k], s) for k, s in zip(names, run.avg.shadow) if k in saved)  # the average
    assert any(not torch.equal(saved[k], last[k]) for k in saved)  # which is not the last weights
    state = torch.load(out / "train_state.pt", weights_only=True)
    assert same(state["model"], last) and same(run.model.state_dict(), last)  # training goes on from the last
    meta = json.loads((out / "checkpoint.json").read_text())
    assert meta["weights"] == "ema" and meta["metrics"] == {"valid_chrf": 1.0}


def test_validating_the_average_scores_it_and_puts_the_last_weights_back(tmp_path, data_dir):
    run = start_run(config(tmp_path, data_dir))
    take_steps(run, 4)
    cfg, max_len = run.cfg, run.model_config.max_len
    last = {k: v.clone() for k, v in run.model.state_dict().items()}
    of_average = validate_average(run.avg, run.model, run.tok, cfg, max_len, final=True)
    assert same(run.model.state_dict(), last) and run.model.training
    run.avg.swap()
    assert of_average == validate(run.model, run.tok, cfg, max_len, final=True)
    assert of_average["valid_sentences"] == len(data.load_pairs(data_dir, "valid"))  # final: the whole split
    assert validate(run.model, run.tok, cfg, max_len)["valid_sentences"] == 6  # on the way: eval_sentences


def test_better_means_higher_chrf_and_lower_bits_per_char():
    assert better({"valid_chrf": 30.1}, {"valid_chrf": 30.0}) and not better({"valid_chrf": 30.0}, {"valid_chrf": 30.1})
    assert better({"valid_bpc": 2.2}, {"valid_bpc": 2.3}) and not better({"valid_bpc": 2.3}, {"valid_bpc": 2.2})
    assert not better({"valid_chrf": 30.0}, {"valid_chrf": 30.0})  # a tie keeps the last weights


def test_the_report_holds_the_metrics_and_draws_both_curves(tmp_path, monkeypatch):
    history = [{"step": 25, "train_loss": 5.0}, {"step": 50, "train_loss": 4.0},
               {"step": 50, "eval": {"valid_bpc": 3.0}, "eval_ema": {"valid_bpc": 2.9}}]
    metrics = {"task": "generate", "final": {"valid_bpc": 2.9}, "history": history}
    write_report(tmp_path, metrics)
    assert json.loads((tmp_path / "metrics.json").read_text()) == metrics
    assert (tmp_path / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.axes

    plotted = []
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, x, y, **kw):
        plotted.append((list(x), list(y), kw["label"]))
        return real_plot(self, x, y, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    write_report(tmp_path, metrics)
    assert plotted == [([25, 50], [5.0, 4.0], "train loss (smoothed CE)"), ([50], [3.0], "valid_bpc"),
                       ([50], [2.9], "valid_bpc (EMA weights)")]


def test_a_run_with_init_starts_from_that_checkpoints_weights_shape_and_tokenizer(tmp_path, data_dir):
    """Fine-tuning: the published model as the start of a run (`kvserve train --init published/translate`)."""
    from model.checkpoint import load_checkpoint

    teacher = start_run(config(tmp_path / "teacher", data_dir))
    take_steps(teacher, 2)
    save_run(teacher)
    init = load_checkpoint(tmp_path / "teacher" / "run")
    run = start_run(config(tmp_path / "student", data_dir, init=str(init.path), vocab_size=200))
    assert run.model_config == init.config and run.tok.vocab_size == init.tokenizer.vocab_size  # not 200
    assert (tmp_path / "student" / "run" / "tokenizer.json").read_bytes() == (init.path / "tokenizer.json").read_bytes()
    assert same(run.model.state_dict(), init.model.state_dict()) and run.model.training
    assert run.step == 0 and not run.opt.state_dict()["state"]  # a new run: fresh optimizer, its own schedule
    assert run.init == {"weights_sha256": init.weights_sha256(), "train_config": init.meta["train_config"],
                        "step": 2, "elapsed_s": 3.0, "metrics": {}, "starts": init.meta["starts"]}
    assert same(run.avg.shadow, list(init.model.parameters()))  # the average starts at the init weights
    take_steps(run, 1)
    save_run(run)
    back = start_run(config(tmp_path / "student", data_dir, init=str(init.path)), resume=True)
    assert back.step == 1 and same(back.model.state_dict(), run.model.state_dict())  # --resume wins over init
    assert back.init == run.init == json.loads((tmp_path / "student" / "run" / "checkpoint.json").read_text())["init"]
    with pytest.raises(ValueError, match="is a translate checkpoint, not generate"):
        start_run(config(tmp_path / "lm", data_dir, task="generate", init=str(init.path)))
