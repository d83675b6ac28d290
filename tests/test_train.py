"""Training runs are reproducible, resumable exactly, and leave their artifacts."""
import json

import pytest
import torch
from safetensors.torch import load_file

from model import data
from model.checkpoint import load_checkpoint
from model.evaluate import evaluate_checkpoint
from model.schedule import FINAL_LR, lr_at, schedule_step, set_lr
from model.train import train
from model.train_config import TrainConfig


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    tsv = d / "pairs.tsv"
    words = ["house", "dog", "cat", "tree", "car", "book"]
    de = ["Haus", "Hund", "Katze", "Baum", "Auto", "Buch"]
    rows = [f"The {w} is big {i}.\tDas {g} ist groß {i}." for i in range(60) for w, g in zip(words, de)]
    tsv.write_text("\n".join(rows) + "\n", encoding="utf-8")
    data.prepare_translation(d, tsv=tsv)
    text = d / "corpus.txt"
    text.write_text("\n\n".join(f"To be or not to be, line {i}.\nThat is the question." for i in range(300)))
    data.prepare_generation(d, text_file=text)
    return d


def cfg(tmp_path, data_dir, task, **kw):
    base = dict(task=task, preset="tiny", out=str(tmp_path / task), data_dir=str(data_dir), steps=8,
                eval_every=4, vocab_size=300, batch_tokens=400, lm_batch=4, lm_window=16, eval_sentences=8,
                warmup=2, seed=7, threads=1)
    return TrainConfig(**{**base, **kw})


def weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("task", ["translate", "generate"])
def test_resume_continues_exactly(tmp_path, data_dir, task):
    train(cfg(tmp_path / "a", data_dir, task))
    train(cfg(tmp_path / "b", data_dir, task, stop_at=3))
    train(cfg(tmp_path / "b", data_dir, task), resume=True)
    wa, wb = weights(tmp_path / "a" / task), weights(tmp_path / "b" / task)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


def test_same_seed_same_result_and_artifacts(tmp_path, data_dir):
    m1 = train(cfg(tmp_path / "a", data_dir, "generate"))
    m2 = train(cfg(tmp_path / "b", data_dir, "generate"))
    assert [h.get("train_loss") for h in m1["history"]] == [h.get("train_loss") for h in m2["history"]]
    out = tmp_path / "a" / "generate"
    assert (out / "loss_curve.png").stat().st_size > 1000
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["steps"] == 8 and "valid_bpc" in saved["final"]


def test_training_learns_and_evaluates(tmp_path, data_dir):
    c = cfg(tmp_path, data_dir, "translate", steps=60, lr=3e-3, eval_every=60)
    m = train(c)
    losses = [h["train_loss"] for h in m["history"] if "train_loss" in h]
    assert losses[-1] < losses[0] - 1.0
    ev = evaluate_checkpoint(c.out, split="test", data_dir=data_dir)
    assert ev["task"] == "translate" and ev["sentences"] > 0 and 0 <= ev["chrf"] <= 100
    ck = load_checkpoint(c.out)
    assert ck.config.vocab_size == ck.tokenizer.vocab_size


def test_schedule_warms_up_then_decays():
    c = TrainConfig(steps=100, warmup=10, lr=1e-3)
    assert lr_at(0, c) < lr_at(9, c) == pytest.approx(1e-3)
    assert lr_at(50, c) < lr_at(10, c) and lr_at(99, c) >= 0.05e-3 - 1e-12


def test_cosine_decay_ends_at_its_floor_and_stays_there():
    c = TrainConfig(steps=110, warmup=10, lr=1e-3)
    assert lr_at(10, c) == pytest.approx(1e-3)  # the peak right after warmup
    assert lr_at(60, c) == pytest.approx(1e-3 * (FINAL_LR + (1 - FINAL_LR) * 0.5))  # halfway: half of the way down
    assert lr_at(35, c) - lr_at(36, c) < lr_at(59, c) - lr_at(60, c)  # a cosine: steepest in the middle
    lrs = [lr_at(s, c) for s in range(10, 111)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # always down after warmup
    assert lr_at(110, c) == lr_at(500, c) == pytest.approx(FINAL_LR * 1e-3)  # the floor, also past `steps`
    opt = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}], lr=1.0)
    assert set_lr(opt, 60, 0.0, c) == lr_at(60, c)
    assert [g["lr"] for g in opt.param_groups] == [lr_at(60, c)] * 2  # every parameter group


def test_recipe_is_the_default_run_with_overrides():
    from model import train as train_mod
    from model.train_config import RECIPES, recipe

    assert train_mod.recipe is recipe and train_mod.TrainConfig is TrainConfig  # kvserve/cli.py imports them there
    r = recipe("translate")
    assert r.steps == RECIPES["translate"]["steps"] and r.out == "artifacts/ckpt/translate" and r.ema == 0.999
    assert recipe("generate", preset="tiny").out == "artifacts/ckpt/generate-tiny"  # another preset, another dir
    assert recipe("generate", preset="tiny", out="x").out == "x"
    assert recipe("translate", lr=5e-4).lr == 5e-4
    with pytest.raises(ValueError, match="unknown task 'summarize'"):
        recipe("summarize")


def test_time_budget_schedule_follows_the_clock():
    c = TrainConfig(steps=1000, time_budget_s=100.0)
    assert schedule_step(10, 50.0, c) == 500  # halfway through the budget: halfway through the schedule
    assert schedule_step(700, 50.0, c) == 700  # a fast machine follows its steps
    assert schedule_step(10, 500.0, c) == 1000
    assert schedule_step(10, 50.0, TrainConfig(steps=1000)) == 10  # no budget: steps only, reproducible
    w = TrainConfig(steps=1000, warmup=100, lr=1e-3, time_budget_s=100.0)
    assert lr_at(10, w, schedule_step(10, 50.0, w)) == pytest.approx(1e-3 * 11 / 100)  # warmup counts real steps
    assert lr_at(200, w, schedule_step(200, 50.0, w)) == pytest.approx(lr_at(500, w))  # the decay follows the clock


def test_resume_keeps_the_model_config_the_run_started_with(tmp_path, data_dir, monkeypatch):
    """--resume (also `make train` after an interrupted run) continues the saved model even when the preset's
    layer counts differ from the ones the run started with."""
    from model import config

    train(cfg(tmp_path / "a", data_dir, "translate"))
    train(cfg(tmp_path / "b", data_dir, "translate", stop_at=3))
    changed = {**config.PRESETS["tiny"]["translate"], "n_encoder_layers": 1, "n_decoder_layers": 3}
    monkeypatch.setitem(config.PRESETS["tiny"], "translate", changed)
    train(cfg(tmp_path / "b", data_dir, "translate"), resume=True)
    assert load_checkpoint(tmp_path / "b" / "translate").config == load_checkpoint(tmp_path / "a" / "translate").config
    wa, wb = weights(tmp_path / "a" / "translate"), weights(tmp_path / "b" / "translate")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


def test_validation_on_the_way_and_once_on_the_whole_split_at_the_end(tmp_path, data_dir):
    """Every eval_every steps on eval_sentences; the last step (end, time budget or --stop-at) only on the whole
    valid split: no partial validation just before the full one."""
    n_valid = len(data.load_pairs(data_dir, "valid"))
    assert n_valid > 8
    for kw, steps in (({}, [4, 8]), ({"stop_at": 3}, [3]), ({"stop_at": 4}, [4])):
        m = train(cfg(tmp_path / str(steps), data_dir, "translate", **kw))
        evals = [h for h in m["history"] if "eval" in h]
        assert [h["step"] for h in evals] == steps, kw
        assert [h["eval"]["valid_sentences"] for h in evals] == [8] * (len(steps) - 1) + [n_valid], kw


def test_resume_after_a_stop_that_kept_the_average_continues_from_the_last_weights(tmp_path, data_dir, monkeypatch):
    """A run that stops (time budget, --stop-at) and keeps the moving average as its weights still saves the
    train state as in training, so --resume continues exactly (from the last weights, not the average)."""
    import model.train as train_mod

    monkeypatch.setattr(train_mod, "better", lambda a, b: True)  # the average is kept at every stop
    kw = dict(ema=0.9)
    a = train(cfg(tmp_path / "a", data_dir, "translate", **kw))
    stopped = train(cfg(tmp_path / "b", data_dir, "translate", stop_at=3, **kw))
    assert a["weights"] == stopped["weights"] == "ema"
    train(cfg(tmp_path / "b", data_dir, "translate", **kw), resume=True)
    wa, wb = weights(tmp_path / "a" / "translate"), weights(tmp_path / "b" / "translate")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)


@pytest.mark.parametrize("task", ["translate", "generate"])
def test_bf16_and_weight_average_resume_exactly_and_keep_the_better_weights(tmp_path, data_dir, task):
    kw = dict(precision="bf16", ema=0.9)
    a = train(cfg(tmp_path / "a", data_dir, task, **kw))
    train(cfg(tmp_path / "b", data_dir, task, stop_at=3, **kw))
    b = train(cfg(tmp_path / "b", data_dir, task, **kw), resume=True)
    wa, wb = weights(tmp_path / "a" / task), weights(tmp_path / "b" / task)
    for k in wa:  # the moving average is part of the train state: a resumed run ends identically
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0)
    assert a["final"] == b["final"] and a["weights"] in ("last", "ema")
    last = a["history"][-1]
    key = "valid_chrf" if task == "translate" else "valid_bpc"
    chosen = last["eval_ema"] if a["weights"] == "ema" else last["eval"]
    other = last["eval"] if a["weights"] == "ema" else last["eval_ema"]
    assert a["final"] == chosen  # the kept weights are the ones whose valid figure is reported
    assert (chosen[key] >= other[key]) if task == "translate" else (chosen[key] <= other[key])
    # the saved weights are the chosen ones: evaluating the checkpoint reproduces the reported figure
    ev = evaluate_checkpoint(str(tmp_path / "a" / task), split="valid", data_dir=data_dir)
    if task == "translate":
        assert ev["chrf"] == pytest.approx(chosen["valid_chrf"], abs=0.01)
    else:
        assert ev["bits_per_char"] == pytest.approx(chosen["valid_bpc"], abs=1e-3)


def test_weight_average_tracks_the_parameters():
    from model.weight_average import WeightAverage
    m = torch.nn.Linear(2, 2)
    avg = WeightAverage(m, decay=0.5)
    with torch.no_grad():
        m.weight.add_(1.0)
    before = avg.shadow[0].clone()
    avg.update(step=1000)  # decay capped at 0.5: halfway to the new weights
    torch.testing.assert_close(avg.shadow[0], before + 0.5)
    w = m.weight.detach().clone()
    avg.swap()
    torch.testing.assert_close(m.weight.detach(), before + 0.5)
    avg.swap()
    torch.testing.assert_close(m.weight.detach(), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_loss_equals_torch_cross_entropy_in_value_and_gradient(dtype, eps, monkeypatch):
    from model import loss as loss_mod
    from model.loss import smoothed_cross_entropy, torch_cross_entropy

    monkeypatch.setattr(loss_mod, "_CHUNK_BYTES", 4 * 500 * 10)  # 10 rows per chunk: 7 chunks, the last partial

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 500, generator=g) * 4).to(dtype)
    target = torch.randint(1, 500, (64,), generator=g)
    target[::5] = 0  # pad positions count for nothing
    grads = []
    for loss_fn in (torch_cross_entropy, smoothed_cross_entropy):
        x = logits.clone().requires_grad_()
        loss = loss_fn(x, target, 0, eps)
        (loss * 3).backward()
        assert torch.equal(x.detach(), logits), "the loss must not change its input"
        grads.append((loss.detach(), x.grad))
    (ref, g_ref), (got, g_got) = grads
    assert g_got.dtype == dtype
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    # fp32: a few ulps of the largest entry; bf16: one rounding of the largest entry may flip (2^-7 of it)
    tol = (1e-6 if dtype == torch.float32 else 2**-7) * g_ref.float().abs().max()
    assert (g_got.float() - g_ref.float()).abs().max() <= tol
    assert g_got[::5].abs().max() == 0


def test_fused_loss_refuses_a_smoothing_outside_0_1():
    from model.loss import smoothed_cross_entropy

    with pytest.raises(ValueError, match="label smoothing must be in"):
        smoothed_cross_entropy(torch.zeros(2, 3), torch.tensor([1, 2]), 0, 1.0)


def test_the_default_recipes_are_steps_not_minutes():
    """`make train` gives the published models again: the published runs' length in optimizer steps, no clock, a
    pinned precision."""
    from model.published import PUBLISHED_DIR, read_manifest
    from model.train_config import DISTILLATION, RECIPES, recipe

    runs = {t: read_manifest(PUBLISHED_DIR / t)["training"] for t in RECIPES}
    # the distilled translator: the recipe's run first (its `init`), then the fine-tune of DISTILLATION
    assert {t: recipe(t).steps for t in RECIPES} == {t: run.get("init", run)["step" if "init" in run else "steps"]
                                                     for t, run in runs.items()}
    assert runs["translate"]["steps"] == DISTILLATION["steps"]
    assert {k: read_manifest(PUBLISHED_DIR / "translate")["recipe"][k] for k in ("lr", "warmup")} == \
        {k: DISTILLATION[k] for k in ("lr", "warmup")}
    assert all(recipe(t).time_budget_s == 0 for t in RECIPES)
    assert all(recipe(t).precision == "bf16-autocast" for t in RECIPES)  # pinned, not chosen by a timing
    assert recipe("translate", time_budget_s=600).time_budget_s == 600  # the opt-in trade of quality for time


@pytest.mark.parametrize("task", ["translate", "generate"])
def test_the_recipe_gives_bit_identical_weights_for_the_same_seed_and_steps(tmp_path, data_dir, task, monkeypatch):
    from model.config import PRESETS
    from model.train_config import recipe

    monkeypatch.setitem(PRESETS["tiny"], task, {**PRESETS["tiny"][task], "dropout": 0.1})  # the RNG takes part
    # the precision pinned to the one "auto" picks on a CPU with native bf16 (a tiny model's measurement can
    # go either way; `kvserve train --precision` pins it the same way); the bf16 twin is as deterministic
    kw = dict(preset="tiny", data_dir=str(data_dir), steps=6, warmup=2, eval_every=1000, vocab_size=300,
              batch_tokens=400, lm_batch=4, lm_window=16, eval_sentences=8, threads=1, precision="bf16-autocast")
    for run in ("a", "b", "c"):
        train(recipe(task, out=str(tmp_path / run), **{**kw, "seed": 9 if run == "c" else 1234}))
    wa, wb, wc = (weights(tmp_path / run) for run in "abc")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)  # another seed, other weights: the test can tell


def test_the_pace_line_says_the_wait_and_how_to_shorten_it():
    from model.train import pace_line

    line = pace_line(TrainConfig(task="translate", steps=4500, eval_every=1000), 30, 2.5)
    assert "2.50 steps/s" in line and "4,470 of 4,500 steps take ~30 min" in line and "--time-budget" in line
    budget = pace_line(TrainConfig(steps=4500, time_budget_s=600), 30, 2.5)
    assert "ends the run after 10 min" in budget


def test_auto_precision_takes_bf16_unless_fp32_is_clearly_faster(monkeypatch):
    from model import precision

    bf16 = "bf16-autocast"
    assert precision.pick({"fp32": 0.0}) == "fp32"  # no native bf16: not measured
    assert precision.pick({"fp32": 300.0, bf16: 200.0}) == bf16
    assert precision.pick({"fp32": 200.0, bf16: 230.0}) == bf16  # within the margin: no flip on noise
    assert precision.pick({"fp32": 200.0, bf16: 400.0}) == "fp32"
    monkeypatch.setattr(precision, "bf16_native", lambda: False)
    assert precision.measure(lambda name: pytest.fail("measured without native bf16")) == {"fp32": 0.0}
    with pytest.raises(ValueError, match="unknown precision 'fp16'"):
        TrainConfig(precision="fp16")


def test_the_bf16_twin_trains_the_fp32_master_weights_and_leaves_the_rng_alone():
    from model.config import preset
    from model.step import choose_precision, make_optimizer, train_step
    from model.transformer import build_model

    torch.manual_seed(0)
    model = build_model(preset("tiny", "generate", 50, 0))
    c = TrainConfig(task="generate", precision="bf16", lr=1e-2, warmup=1)
    batch = (torch.randint(4, 50, (4, 9)), torch.randint(4, 50, (4, 9)))
    rng, before = torch.get_rng_state(), [p.detach().clone() for p in model.parameters()]
    chosen, ms = choose_precision(model, batch, c, 0)
    assert chosen in ("fp32", "bf16-autocast") and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # measured on a copy
    from model.precision import Bf16Twin
    twin, opt = Bf16Twin(model), make_optimizer(model, c)
    losses = [float(train_step(model, opt, batch, c, 0, twin=twin)[0]) for _ in range(20)]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in twin.model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the master moved
    assert losses[-1] < losses[0] - 0.5  # and learns
