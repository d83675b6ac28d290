"""Export of tiny random models: graphs, contracts, fp32 parity with PyTorch, greedy equality, the CLI."""
import argparse

import onnx
import pytest

from export.bundle import load_bundle
from kvserve.export import ExportError, build_bundle, register
from export.evaluate import greedy_decode
from export.parity import (FP32_TOLERANCE, SYNTHETIC_BATCHES, TorchRuntime, identical_by_prefix, lockstep,
                           synthetic_inputs)
from export.variants import count_ops
from export_once import shared_exports
from model.checkpoint import load_checkpoint
from serving.engine.runtime import ModelRuntime
from tests.helpers_tiny import checkpoint_of, tiny_bundle, tiny_checkpoint

TASKS = ("translate", "generate")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    base = tmp_path_factory.mktemp("export")
    return {task: tiny_bundle(base, task) for task in TASKS}


@pytest.mark.parametrize("task", TASKS)
def test_every_graph_passes_onnx_checker_and_uses_fused_ops(bundles, task):
    b = load_bundle(bundles[task])
    decoders = {"decoder", "decoder_cpu"}
    assert set(b.paths) == (decoders | {"encoder"} if task == "translate" else decoders)
    for name, path in b.paths.items():
        onnx.checker.check_model(str(path), full_check=True)
    # decoder.onnx, the portable graph: SDPA became the fused ONNX Attention op; one in-place KV write per
    # cache (keys and values of each layer), no concat-style cache growth: the past caches feed
    # TensorScatter and nothing that would copy them
    for name in b.paths.keys() - {"decoder_cpu"}:
        assert count_ops(b.paths[name])["Attention"] >= 1, f"{name}: SDPA did not become the Attention op"
    n_layers = b.config.n_decoder_layers
    assert count_ops(b.paths["decoder"])["TensorScatter"] == 2 * n_layers
    # decoder_cpu.onnx: one GroupQueryAttention per self-attention, which takes the caches itself, and for a
    # translator one per cross-attention (over each row's own source), no ONNX Attention left
    ops = count_ops(b.paths["decoder_cpu"])
    cross = task == "translate"
    assert ops["GroupQueryAttention"] == (2 if cross else 1) * n_layers and ops["TensorScatter"] == 0
    assert ops["Attention"] == 0
    for name, allowed in (("decoder", {"TensorScatter", "Shape"}), ("decoder_cpu", {"GroupQueryAttention"})):
        graph = onnx.load(str(b.paths[name])).graph
        for past in (i.name for i in graph.input if i.name.startswith("past_")):
            consumers = {n.op_type for n in graph.node if past in n.input}
            assert consumers <= allowed, (name, past, consumers)
    # the cross buffers feed the kernel (as its past) and the GatherElements of each row's last key/value only:
    # nothing copies or transposes a whole buffer
    graph = onnx.load(str(b.paths["decoder_cpu"])).graph
    for c in (i.name for i in graph.input if i.name.startswith("cross_")):
        consumers = {n.op_type for n in graph.node if c in n.input}
        assert consumers <= {"GroupQueryAttention", "Reshape", "Shape"}, (c, consumers)


@pytest.mark.parametrize("graph", ["decoder", "decoder_cpu"])
@pytest.mark.parametrize("task", TASKS)
def test_fp32_logits_match_pytorch_at_every_step_untraced_shapes(bundles, task, graph):
    """Batch sizes 1, 2, 5, 7 and lengths 1..13 (traced: batch 3, 4 new tokens, 5 source tokens), right-padded
    mixed lengths, 20 greedy steps, rows bound at an offset inside the slot pool."""
    ck = load_checkpoint(checkpoint_of(bundles[task]))
    rt = ModelRuntime(load_bundle(bundles[task]), n_slots=9, provider="cpu", decoder_graph=graph)
    ref = TorchRuntime(ck.model, 9, ck.tokenizer.special_ids)
    bos = None if task == "translate" else ck.tokenizer.bos_id
    for i, (batch, lengths) in enumerate(SYNTHETIC_BATCHES):
        inputs = synthetic_inputs(ck.config.vocab_size, lengths, seed=100 + i, bos=bos)
        r = lockstep(ref, rt, inputs, steps=20, start=9 - batch)
        assert r["steps"] == 20
        assert max(r["per_step_max_abs"]) <= FP32_TOLERANCE, r
        assert r["rows_greedy_identical"] == batch, r


@pytest.mark.parametrize("graph", ["decoder", "decoder_cpu"])
@pytest.mark.parametrize("task", TASKS)
def test_greedy_outputs_identical_to_pytorch(bundles, task, graph):
    ck = load_checkpoint(checkpoint_of(bundles[task]))
    tok = ck.tokenizer
    rt = ModelRuntime(load_bundle(bundles[task]), n_slots=6, provider="cpu", decoder_graph=graph)
    ref = TorchRuntime(ck.model, 6, tok.special_ids)
    texts = ["Where is the cat?", "Good morning.", "The children read a book in the garden today.", "Tür",
             "We go.", "Bitte!", "A cup of coffee, please."]
    if task == "translate":
        inputs = [tok.encode(t) for t in texts]
    else:
        inputs = [[tok.bos_id, *tok.encode(t)] for t in texts]
    a = greedy_decode(ref, inputs, max_new_tokens=25, batch_size=6)  # batches of 6 and 1
    b = greedy_decode(rt, inputs, max_new_tokens=25, batch_size=6)
    assert a == b
    assert sum(map(len, a)) > 7 * 5  # a random model does not stop at once: the comparison has substance


def test_unequal_encoder_and_decoder_depths_export_with_parity(bundles):
    """The shipped translator has 2 encoder and 4 decoder layers (the tiny preset 2 + 2): the tiny translator
    of these tests has 2 + 3 (tests/helpers_tiny.py), and its graphs give PyTorch's logits and greedy tokens,
    so no graph mixes up the two depths."""
    ck, bundle = load_checkpoint(checkpoint_of(bundles["translate"])), load_bundle(bundles["translate"])
    assert (bundle.config.n_encoder_layers, bundle.config.n_decoder_layers) == (2, 3)
    batch, lengths = SYNTHETIC_BATCHES[-1]
    for graph in ("decoder", "decoder_cpu"):
        rt = ModelRuntime(bundle, n_slots=9, provider="cpu", decoder_graph=graph)
        ref = TorchRuntime(ck.model, 9, ck.tokenizer.special_ids)
        inputs = synthetic_inputs(ck.config.vocab_size, lengths, seed=7, bos=None)
        r = lockstep(ref, rt, inputs, steps=20, start=9 - batch)
        assert max(r["per_step_max_abs"]) <= FP32_TOLERANCE and r["rows_greedy_identical"] == batch, (graph, r)


def test_manifest_records_hashes_source_and_parity(bundles):
    m = load_bundle(bundles["translate"]).manifest
    assert set(m["files"]) == {"tokenizer.json", "encoder.onnx", "decoder.onnx", "decoder_cpu.onnx"}
    assert all(len(h) == 64 for h in m["files"].values())
    assert len(m["source"]["weights_sha256"]) == 64
    assert m["tokenizer"]["special_ids"] == {"pad": 0, "bos": 1, "eos": 2, "unk": 3}
    assert m["opset"] >= 24 and m["variant"] == "fp32"
    syn = m["parity"]["synthetic_cpu"]
    assert syn["logits_max_abs"] <= FP32_TOLERANCE and syn["rows_greedy_identical"] == syn["rows"] > 0


def test_export_command_prints_report_and_refuses_to_overwrite_without_force(tmp_path, capsys):
    """The command around build_bundle; the ONNX export of these weights (tests/engine_bundle.py's random
    generate model) is shared with the test run's other bundles of them (tests/export_once.py)."""
    ck = tiny_checkpoint(tmp_path / "ck", "generate", train_steps=0)
    out = tmp_path / "bundle"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["export", str(ck), "--out", str(out), "--threads", "1"])
    with pytest.raises(ExportError, match="already exists.*--force"):
        args.func(args)
    assert (out / "precious.txt").read_text() == "keep me"
    args = parser.parse_args(["export", str(ck), "--out", str(out), "--threads", "1", "--force"])
    with shared_exports():
        assert args.func(args) == 0
    report = capsys.readouterr().out
    assert "decoder.onnx" in report and "logits max-abs" in report and "timings" in report
    assert not (out / "precious.txt").exists()
    assert load_bundle(out).task == "generate"
    assert not list(tmp_path.glob(".bundle.partial-*"))  # no temporary directory left behind


def test_exported_opset_below_24_is_refused(tmp_path):
    ck = tiny_checkpoint(tmp_path / "ck", "generate", train_steps=0)
    with pytest.raises(ValueError, match="TensorScatter"):
        build_bundle(ck, tmp_path / "b", opset=20)


def _data_dir(tmp_path, task):
    from tests.helpers_tiny import PAIRS

    d = tmp_path / "data" / task
    d.mkdir(parents=True)
    if task == "translate":
        pairs = PAIRS + [("Where is my book?", "Wo ist mein Buch?")]
        (d / "test.tsv").write_text("".join(f"{e}\t{g}\n" for e, g in pairs))
    else:
        (d / "test.txt").write_text(" ".join(f"{e} {g}" for e, g in PAIRS) * 3)
    return tmp_path / "data"


@pytest.mark.parametrize("task", TASKS)
def test_evaluate_bundle_gives_the_checkpoint_figures(bundles, task, tmp_path):
    """`kvserve evaluate BUNDLE` (ONNX Runtime) reports what `kvserve evaluate CHECKPOINT` (PyTorch) does."""
    from export.evaluate import evaluate_bundle
    from kvserve.runtime import ort_runtime
    from model.evaluate import evaluate_checkpoint

    data_dir = _data_dir(tmp_path, task)
    got = evaluate_bundle(bundles[task], ort_runtime(), "test", None, data_dir)
    want = evaluate_checkpoint(checkpoint_of(bundles[task]), "test", None, data_dir)
    if task == "translate":
        assert got["sentences"] == want["sentences"] == 9
        assert got["chrf"] == want["chrf"] and got["bleu"] == want["bleu"]
        assert got["chrf"] > 20  # the tiny model was fitted to these sentences: the check has substance
    else:
        assert got["chars"] == want["chars"] and got["tokens"] == want["tokens"]
        assert got["bits_per_char"] == pytest.approx(want["bits_per_char"], abs=2e-4)
        assert got["bits_per_char"] < 6


def test_evaluate_with_beam_search_gives_the_same_figures_through_the_engine_and_pytorch(bundles, tmp_path, capsys):
    """`kvserve evaluate --beam-size 3` on the bundle (the serving engine's beam search) and on its checkpoint
    (model/decode.py's) agree, and beam search on an LM is refused with a message that says why."""
    import json

    from kvserve import cli

    data_dir = _data_dir(tmp_path, "translate")
    reports = []
    for path in (bundles["translate"], checkpoint_of(bundles["translate"])):
        assert cli.main(["evaluate", str(path), "--data-dir", str(data_dir), "--beam-size", "3"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    engine, torch_ = reports
    assert engine["backend"] == "engine" and torch_["backend"] == "pytorch"
    keys = ("chrf", "bleu", "sentences", "beam_size", "length_penalty")
    assert {k: engine[k] for k in keys} == {k: torch_[k] for k in keys} and engine["beam_size"] == 3
    assert engine["chrf"] > 20
    lm = _data_dir(tmp_path / "lm", "generate")
    for path in (bundles["generate"], checkpoint_of(bundles["generate"])):
        assert cli.main(["evaluate", str(path), "--data-dir", str(lm), "--beam-size", "2"]) == 2
        assert "beam search is for translation" in capsys.readouterr().err


@pytest.mark.parametrize("task", TASKS)
def test_parity_command_runs_the_bundle_through_ort_against_pytorch(bundles, task, tmp_path, capsys):
    """`python -m kvserve.parity BUNDLE CKPT`: export/parity.py `real_parity` with serving's ONNX Runtime
    injected (kvserve/runtime.py): fp32 logits within tolerance, the same greedy outputs, no quality change."""
    import json

    from kvserve.parity import main

    data_dir = _data_dir(tmp_path, task)
    if task == "generate":  # prompts (120 characters from a line start) must fit the tiny model's max_len 64
        (data_dir / task / "test.txt").write_text("Good morning.\nThank you.\nWe go.\n")
    assert main([str(bundles[task]), str(checkpoint_of(bundles[task])), "--sentences", "9", "--steps", "8",
                 "--batch-size", "4", "--provider", "cpu", "--data-dir", str(data_dir)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["provider"] == "CPUExecutionProvider" and r["task"] == task
    assert r["lockstep"]["logits_max_abs"] <= FP32_TOLERANCE
    assert r["lockstep"]["rows_greedy_identical"] == r["lockstep"]["rows"] > 0
    assert r["greedy"]["identical_fraction"] == 1.0
    assert set(r["greedy"]["identical_fraction_by_tokens"].values()) == {1.0}
    delta = r["quality"]["chrf_delta"] if task == "translate" else r["quality"]["bpc_delta"]
    assert abs(delta) <= 1e-3, r["quality"]


def test_identical_by_prefix_counts_outputs_alike_up_to_each_length():
    a = [[5, 6, 7, 8], [5, 6], [1, 2, 3]]
    b = [[5, 6, 9, 8], [5, 6], [4, 2, 3]]  # the first parts at token 3, the second is the same, the third at 1
    assert identical_by_prefix(a, b, [1, 2, 3, 8]) == {"1": 0.6667, "2": 0.6667, "3": 0.3333, "8": 0.3333}
