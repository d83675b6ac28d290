"""serving/engine/sampling.py: greedy, repetition penalty, temperature, top-k, top-p and per-request seeds."""
import numpy as np
import pytest

from serving.engine.sampling import (apply_repetition_penalty, filter_top_k_top_p, greedy, is_plain_greedy,
                                     is_plain_sampling, make_generator, sample_plain, sample_row)
from serving.engine.types import SamplingParams

EMPTY = np.zeros(0, dtype=np.int64)


def draws(logits, params, n=4000, seed=0, history=EMPTY):
    rng = make_generator(seed)
    return np.array([sample_row(logits, params, rng, history) for _ in range(n)])


def test_greedy_is_rowwise_argmax_first_on_ties():
    logits = np.array([[0, 3, 3, 1], [5, -1, 2, 2], [0, 0, 0, 0]], dtype=np.float32)
    assert greedy(logits).tolist() == [1, 0, 0]


def test_plain_greedy_detection():
    assert is_plain_greedy(SamplingParams())
    assert not is_plain_greedy(SamplingParams(temperature=0.5))
    assert not is_plain_greedy(SamplingParams(repetition_penalty=1.2))
    assert not is_plain_greedy(SamplingParams(beam_size=2))


def test_repetition_penalty_divides_positive_multiplies_negative_only_seen_ids():
    row = np.array([2.0, -2.0, 4.0, -1.0])
    out = apply_repetition_penalty(row.copy(), np.array([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 4.0, -1.0]


def test_repetition_penalty_changes_the_greedy_choice():
    logits = np.array([0.0, 3.0, 2.5], dtype=np.float32)
    p = SamplingParams(repetition_penalty=1.5)
    assert sample_row(logits, p, make_generator(0), np.array([1])) == 2
    assert sample_row(logits, SamplingParams(), make_generator(0), np.array([1])) == 1


def test_sample_row_leaves_the_callers_logits_alone():
    logits = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    sample_row(logits, SamplingParams(temperature=0.7, top_k=2, repetition_penalty=1.3), make_generator(1),
               np.array([2]))
    assert logits.tolist() == [1.0, 2.0, 3.0]


def test_temperature_sampling_follows_the_softmax():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    freq = np.bincount(draws(logits, SamplingParams(temperature=1.0)), minlength=3) / 4000
    assert np.abs(freq - [0.5, 0.3, 0.2]).max() < 0.03
    # temperature 0.5 squares the probabilities (then renormalises)
    want = np.array([0.25, 0.09, 0.04]) / 0.38
    freq = np.bincount(draws(logits, SamplingParams(temperature=0.5)), minlength=3) / 4000
    assert np.abs(freq - want).max() < 0.03


def test_top_k_restricts_the_support_to_the_k_best():
    logits = np.array([0.1, 2.0, 0.0, 1.9, 1.8, -1.0], dtype=np.float32)
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_k=3), n=2000).tolist())
    assert seen == {1, 3, 4}
    assert set(draws(logits, SamplingParams(temperature=5.0, top_k=1), n=200).tolist()) == {1}


@pytest.mark.parametrize("top_p,support", [(0.5, {0}), (0.79, {0, 1}), (0.81, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, support):
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_p=top_p), n=3000).tolist())
    assert seen == support


def test_filter_returns_renormalised_probabilities_best_first():
    ids, probs = filter_top_k_top_p(np.log(np.array([0.1, 0.6, 0.3])), top_k=2, top_p=1.0)
    assert ids.tolist() == [1, 2]
    assert probs == pytest.approx([2 / 3, 1 / 3])


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    p = SamplingParams(temperature=1.0, top_p=0.95)
    a, b, c = draws(logits, p, 50, seed=7), draws(logits, p, 50, seed=7), draws(logits, p, 50, seed=8)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_one_uniform_draw_per_token_whatever_the_filter():
    """A request's stream of draws must not depend on its params' path (sort or not), only on the seed."""
    logits = np.random.default_rng(1).normal(size=20).astype(np.float32)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5),
                   SamplingParams(temperature=1.0, top_p=0.9)):
        rng = make_generator(3)
        sample_row(logits, params, rng, EMPTY)
        assert rng.random() == make_generator(3).random(2)[1]


def _exact_inverse_cdf(row: np.ndarray, temperature: float, u: float) -> int:
    x = row.astype(np.float64) / temperature
    cdf = np.cumsum(np.exp(x - x.max()))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), row.shape[0] - 1))


@pytest.mark.parametrize("vocab", [1, 3, 64, 65, 8000])
def test_sample_plain_inverts_the_cdf_row_by_row_whatever_the_batch(vocab):
    rs = np.random.RandomState(vocab)
    n = 17
    logits = (rs.randn(n, vocab) * 4).astype(np.float32)
    if vocab > 3:
        logits[:, rs.randint(0, vocab, 5)] = -np.inf  # banned ids
    temps, u = rs.choice([0.3, 1.0, 1.7], n), rs.rand(n)
    got = sample_plain(logits, temps, u)
    assert got.dtype == np.int64 and got.shape == (n,)
    for i in range(n):
        assert np.isfinite(logits[i, got[i]])  # never a token of zero probability
        assert sample_plain(logits[i:i + 1], temps[i:i + 1], u[i:i + 1])[0] == got[i]  # batch-invariant
    exact = [_exact_inverse_cdf(logits[i], temps[i], u[i]) for i in range(n)]
    assert np.mean(got == np.array(exact)) >= 0.9  # float32 exponentials: a draw on a boundary may differ


def test_sample_plain_draws_the_softmax_distribution_and_never_a_zero_probability_tail():
    probs = np.array([0.5, 0.3, 0.2] + [0.0] * 125)
    with np.errstate(divide="ignore"):
        logits = np.log(probs).astype(np.float32)
    n = 40_000
    got = sample_plain(np.repeat(logits[None], n, 0), np.ones(n), make_generator(0).random(n))
    freq = np.bincount(got, minlength=probs.size) / n
    assert np.abs(freq[:3] - probs[:3]).max() < 0.01 and freq[3:].sum() == 0
    # u just below 1 lands on the last token with mass, not on the zero tail past it
    assert sample_plain(logits[None], np.ones(1), np.array([np.nextafter(1.0, 0)]))[0] == 2


def test_plain_sampling_is_temperature_alone():
    assert is_plain_sampling(SamplingParams(temperature=0.7))
    for p in (SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0.7, repetition_penalty=1.1), SamplingParams(temperature=0.7, beam_size=2)):
        assert not is_plain_sampling(p)
