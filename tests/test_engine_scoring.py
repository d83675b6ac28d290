"""Log-probabilities, forced tokens, penalties and biases in the engine, on tiny exported models held to PyTorch.

The acceptance: a token's log-probability (and its top alternatives) equals PyTorch's log-softmax of the same
model on the same prefix within 1e-3; forced tokens come out verbatim, scored, and the continuation after them is
PyTorch's greedy continuation of the forced prefix; penalties, biases, min_tokens and no_repeat_ngram_size change
the choice as specified; none of it changes what the request's batch-mates generate.
"""
import numpy as np
import pytest
import torch

from engine_bundle import cached_bundle
from engine_util import outcome, run_all, tokens
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.sampling import adjust_logits
from serving.engine.types import FinishReason, GenerationRequest, InvalidRequest, SamplingParams

BOS, EOS = 1, 2


async def engine(task: str) -> Engine:
    bundle, _ = cached_bundle(task)
    eng = Engine.from_bundle(bundle, EngineConfig(max_slots=16, max_tokens_per_step=256))
    await eng.start()
    return eng


@torch.no_grad()
def lm_logprobs(model, ids: list[int]) -> np.ndarray:
    """(len(ids), V): PyTorch's next-token log-probabilities after each prefix of ids."""
    return torch.log_softmax(model(torch.tensor([ids])).double(), -1)[0].numpy()


@torch.no_grad()
def mt_logprobs(model, src: list[int], decoder_in: list[int]) -> np.ndarray:
    logits = model(torch.tensor([src]), torch.tensor([len(src)]), torch.tensor([decoder_in]))
    return torch.log_softmax(logits.double(), -1)[0].numpy()


def req(rid: str, prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(**params))


async def test_token_logprobs_and_top_5_equal_pytorch_log_softmax():
    _, model = cached_bundle("generate")
    eng = await engine("generate")
    prompt = [BOS, 17, 42, 99, 5]
    events = (await run_all(eng, [req("a", prompt, max_new_tokens=12, logprobs=5),
                                  req("b", prompt, max_new_tokens=12, temperature=0.9, seed=3, logprobs=2)]))
    await eng.stop()
    for evs in events:
        got = tokens(evs)
        ref = lm_logprobs(model, prompt + got)[len(prompt) - 1:]
        steps = [e for e in evs if e.token_id is not None]
        assert len(steps) == 12
        for i, e in enumerate(steps):
            assert abs(e.logprob - ref[i, e.token_id]) < 1e-3
            want = np.argsort(-ref[i])[: len(e.top_logprobs)]
            assert [t for t, _ in e.top_logprobs] == list(want)
            assert np.allclose([lp for _, lp in e.top_logprobs], ref[i, want], atol=1e-3)
    assert len(events[0][0].top_logprobs) == 5 and len(events[1][0].top_logprobs) == 2
    assert tokens(events[0]) == [int(np.argmax(r)) for r in lm_logprobs(model, prompt + tokens(events[0]))[4:-1]]


async def test_forced_tokens_are_scored_and_the_continuation_is_pytorch_greedy_after_them():
    """A decoder-only prompt fed as forced tokens after bos: its own log-probabilities (echo with logprobs)."""
    _, model = cached_bundle("generate")
    eng = await engine("generate")
    prompt = [17, 42, 99, 5, 8]
    evs = (await run_all(eng, [req("f", [BOS], max_new_tokens=len(prompt) + 6, forced_ids=tuple(prompt),
                                   logprobs=1)]))[0]
    plain = (await run_all(eng, [req("p", [BOS] + prompt, max_new_tokens=6)]))[0]
    await eng.stop()
    got = tokens(evs)
    assert got[: len(prompt)] == prompt and got[len(prompt):] == tokens(plain)
    ref = lm_logprobs(model, [BOS] + got)
    scored = [e for e in evs if e.token_id is not None]
    assert np.allclose([e.logprob for e in scored], [ref[i, t] for i, t in enumerate(got)], atol=1e-3)


async def test_a_forced_translation_prefix_is_kept_and_scored_and_the_rest_is_greedy():
    _, model = cached_bundle("translate")
    eng = await engine("translate")
    src = [30, 31, 32, 33, 34, 35]
    free = tokens((await run_all(eng, [req("x", src, max_new_tokens=10)]))[0])
    prefix = (free[0] + 1) % 300 or 3, 7  # a start the model would not choose
    evs = (await run_all(eng, [req("y", src, max_new_tokens=12, forced_ids=prefix, logprobs=0)]))[0]
    await eng.stop()
    got = tokens(evs)
    assert tuple(got[:2]) == prefix
    ref = mt_logprobs(model, src, [BOS] + got)
    for i in range(2, len(got)):  # after the prefix: the argmax of PyTorch's logits on that prefix
        assert got[i] == int(np.argmax(ref[i])), i
    scored = [e for e in evs if e.token_id is not None]
    assert np.allclose([e.logprob for e in scored], [ref[i, t] for i, t in enumerate(got)], atol=1e-3)
    assert all(e.top_logprobs == () for e in scored)


async def test_scoring_a_translation_with_its_eos_gives_the_stop_tokens_logprob():
    _, model = cached_bundle("translate")
    eng = await engine("translate")
    src, target = [40, 41, 42, 43], [9, 10, 11]
    evs = (await run_all(eng, [req("s", src, max_new_tokens=4, forced_ids=(*target, EOS), logprobs=0)]))[0]
    await eng.stop()
    assert outcome(evs) == (target, FinishReason.STOP)
    ref = mt_logprobs(model, src, [BOS, *target])
    final = evs[-1]
    assert final.end_token == EOS and abs(final.logprob - ref[3, EOS]) < 1e-3
    total = sum(e.logprob for e in evs)
    assert abs(total - sum(ref[i, t] for i, t in enumerate([*target, EOS]))) < 1e-3


def test_adjust_logits_applies_bias_penalties_min_tokens_and_no_repeat_ngrams():
    row = np.zeros(10)
    p = SamplingParams(logit_bias=((3, 5.0),), presence_penalty=1.0, frequency_penalty=0.5, min_tokens=4)
    adjust_logits(row, p, generated=[4, 4, 6], decoded=[1, 4, 4, 6], end_ids=frozenset({2}))
    assert row[3] == 5.0 and row[4] == -2.0 and row[6] == -1.5 and row[2] == -np.inf and row[5] == 0.0
    row = np.zeros(10)
    adjust_logits(row, SamplingParams(no_repeat_ngram_size=3), [], decoded=[5, 6, 7, 5, 6, 8, 5, 6],
                  end_ids=frozenset())
    assert set(np.flatnonzero(row == -np.inf)) == {7, 8}  # "5 6 7" and "5 6 8" already occurred


async def test_biases_and_constraints_steer_generation_and_leave_batch_mates_alone():
    eng = await engine("generate")
    prompt = [BOS, 17, 42]
    mates = [req(f"m{i}", [BOS, 20 + i, 9], max_new_tokens=10, temperature=0.7, seed=i) for i in range(4)]
    alone = [outcome(e) for e in await run_all(eng, mates)]
    mates = [GenerationRequest(m.request_id + "'", m.prompt_ids, m.params) for m in mates]
    special = [req("bias", prompt, max_new_tokens=8, logit_bias=((77, 100.0),)),
               req("ngram", prompt, max_new_tokens=20, no_repeat_ngram_size=1),
               req("freq", prompt, max_new_tokens=20, frequency_penalty=2.0, logprobs=0)]
    got = await run_all(eng, special + mates)
    await eng.stop()
    assert tokens(got[0]) == [77] * 8
    ngram = tokens(got[1])
    assert len(set(ngram + prompt)) == len(ngram) + len(prompt)  # nothing the decoder saw comes again
    assert [outcome(e) for e in got[3:]] == alone


async def test_min_tokens_holds_eos_back_until_then():
    """eos pushed to the top by a bias: the request ends the moment min_tokens allows it."""
    eng = await engine("translate")
    srcs = [[30 + i, 31, 32 + i] for i in range(4)]
    got = await run_all(eng, [req(f"m{i}", s, max_new_tokens=20, min_tokens=3 + i, logit_bias=((EOS, 100.0),))
                              for i, s in enumerate(srcs)])
    await eng.stop()
    assert [(len(t), why) for t, why in map(outcome, got)] == [(3 + i, FinishReason.STOP) for i in range(4)]


@pytest.mark.parametrize("params,field", [
    (dict(logprobs=-1), "logprobs"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logit_bias=((999, 1.0),)), "logit_bias"), (dict(logit_bias=((3, 101.0),)), "logit_bias"),
    (dict(min_tokens=9, max_new_tokens=8), "min_tokens"), (dict(forced_ids=(1, 2, 3), max_new_tokens=2), "forced_ids"),
    (dict(beam_size=2, logprobs=1), "logprobs"),
])
async def test_bad_scoring_params_are_refused_naming_the_field(params, field):
    eng = await engine("translate")
    with pytest.raises(InvalidRequest) as e:
        eng.submit(req("bad", [5, 6], **params))
    await eng.stop()
    assert e.value.field == field
