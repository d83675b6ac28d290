"""model/batching.py: every pair once per epoch under the token budget, padded tensors, batches by step."""
import random

import pytest
import torch

from model import data
from model.batching import Batcher, collate_pairs, lm_windows, translation_batches
from model.tokenizer import Tokenizer
from model.train_config import TrainConfig

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A prepared data dir (both tasks) and a tokenizer trained on it."""
    d = tmp_path_factory.mktemp("data")
    rows = [f"The {w} number {i} is {'very ' * (i % 4)}big.\tDas {g} Nummer {i} ist {'sehr ' * (i % 4)}groß."
            for i in range(50) for w, g in (("house", "Haus"), ("dog", "Hund"), ("tree", "Baum"))]
    (d / "pairs.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    data.prepare_translation(d, tsv=d / "pairs.tsv")
    (d / "corpus.txt").write_text("\n\n".join(f"To be or not to be, line {i}." for i in range(200)))
    data.prepare_generation(d, text_file=d / "corpus.txt")
    texts = [s for p in data.load_pairs(d, "train") for s in p] + data.load_text(d, "train").split("\n")
    return d, Tokenizer.train(texts, 300)


def random_pairs(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([5] * rng.randint(0, 30), [6] * rng.randint(1, 30)) for _ in range(n)]


def padded_tokens(pairs, batch) -> int:
    return max(len(pairs[i][0]) + len(pairs[i][1]) + 1 for i in batch) * len(batch)


def test_translation_batches_hold_every_pair_once_under_the_budget_in_a_seeded_order():
    pairs = random_pairs(500)
    epochs = [translation_batches(pairs, 300, seed=1, epoch=e) for e in range(3)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(pairs)))  # each pair exactly once
        assert all(padded_tokens(pairs, b) <= 300 for b in batches)
        lengths = [sorted(len(pairs[i][1]) for i in b) for b in batches]
        assert max(hi[-1] - hi[0] for hi in lengths) <= 2  # bucketed: similar target lengths in a batch
    assert translation_batches(pairs, 300, seed=1, epoch=1) == epochs[1]  # a function of (seed, epoch)
    assert epochs[0] != epochs[1] and translation_batches(pairs, 300, seed=2, epoch=1) != epochs[1]
    assert len({len(b) for b in epochs}) == 1  # the packing depends on the lengths only: as many batches
    long = [([5] * 40, [6] * 40)]  # a pair over the budget still gets a batch of its own
    assert translation_batches(long + pairs[:3], 50, seed=0, epoch=0).count([0]) == 1


def test_collate_pairs_pads_and_frames_the_target_with_bos_and_eos():
    pairs = [([5, 6, 7], [8, 9]), ([], [10]), ([11], [12, 13, 14])]
    src, lens, tin, tout = collate_pairs(pairs, [0, 1], PAD, BOS, EOS)
    assert src.tolist() == [[5, 6, 7], [0, 0, 0]]
    assert lens.tolist() == [3, 1]  # an empty source still has one key to attend to
    assert tin.tolist() == [[1, 8, 9], [1, 10, 0]]
    assert tout.tolist() == [[8, 9, 2], [10, 2, 0]]
    src, lens, tin, tout = collate_pairs(pairs, [2], PAD, BOS, EOS)
    assert (src.tolist(), lens.tolist(), tin.tolist(), tout.tolist()) == ([[11]], [1], [[1, 12, 13, 14]],
                                                                          [[12, 13, 14, 2]])


def test_lm_windows_predict_each_token_of_the_window_from_bos_and_the_ones_before():
    stream = torch.arange(100, 200)
    x, y = lm_windows(stream, [0, 37], window=5, bos=BOS)
    assert x.shape == y.shape == (2, 6)
    assert x[:, 0].tolist() == [BOS, BOS]
    assert y[1].tolist() == list(range(137, 143))
    assert torch.equal(x[:, 1:], y[:, :-1])  # the input is the target shifted right by one


def test_the_batch_of_a_step_depends_on_the_step_only_across_epochs(corpus):
    d, tok = corpus
    cfg = TrainConfig(task="translate", data_dir=str(d), batch_tokens=200, seed=3)
    walked, fresh = Batcher(cfg, tok, 64), Batcher(cfg, tok, 64)
    n = walked.batches_per_epoch
    assert n > 2
    seen = [walked.batch(step) for step in range(n + 3)]  # through the first epoch into the second
    assert sum(b[0].shape[0] for b in seen[:n]) == len(walked.pairs)  # an epoch covers every pair once
    for step in (n + 2, 1, n):  # a resumed run's batcher jumps straight to its step, back and forth
        assert all(torch.equal(a, b) for a, b in zip(fresh.batch(step), seen[step]))
    second = translation_batches(walked.pairs, 200, 3, epoch=1)[2]
    expected = collate_pairs(walked.pairs, second, tok.pad_id, tok.bos_id, tok.eos_id)
    assert all(torch.equal(a, b) for a, b in zip(seen[n + 2], expected))  # step n + 2: epoch 1's batch 2
    assert any(not torch.equal(seen[k][0], seen[n + k][0]) for k in range(3))  # a new order each epoch

    lm = TrainConfig(task="generate", data_dir=str(d), lm_batch=3, lm_window=16, seed=3)
    a, b = Batcher(lm, tok, 64), Batcher(lm, tok, 64)
    x, y = a.batch(7)
    assert x.shape == (3, 17) and torch.equal(x, b.batch(7)[0]) and not torch.equal(x, a.batch(8)[0])
    assert Batcher(lm, tok, 10).batch(0)[0].shape == (3, 10)  # the window fits the model's max_len
