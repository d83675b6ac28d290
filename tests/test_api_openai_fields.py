"""OpenAI completions' logprobs, echo, n, best_of, penalties and logit_bias through the official `openai` client, on
the real engine of a tiny bundle (tests/inprocess_app.py), held to PyTorch's log-softmax of the same model.

The acceptance: `logprobs=5`, `echo=True`, `n=3`, `best_of=3`, streaming and not, all answered; the returned
logprobs equal PyTorch's within 1e-3; `n` sequences with distinct seeds each equal the same request run alone with
that seed.
"""
from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from inprocess_app import InProcessServer
from model.tokenizer import Tokenizer
from serving.server.config import Limits

LIMITS = Limits(max_prompt_tokens=40, max_tokens=16, default_max_tokens=8, max_texts=8)
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(LIMITS)
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(load_bundle(cached_bundle("generate")[0]).tokenizer_path)


def client(server: InProcessServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=server.client)


@torch.no_grad()
def reference(ids: list[int]) -> np.ndarray:
    """PyTorch's next-token log-probabilities after each prefix of ids (the generate bundle's own model)."""
    model = cached_bundle("generate")[1]
    return torch.log_softmax(model(torch.tensor([ids])).double(), -1)[0].numpy()


def create(server: InProcessServer, **kw):
    return server.call(client(server).completions.create(model="generate", prompt=PROMPT, **kw))


def test_logprobs_5_equal_pytorch_and_name_the_top_tokens(server, tok):
    c = create(server, max_tokens=8, temperature=0, logprobs=5)
    lp = c.choices[0].logprobs
    prompt = [tok.bos_id] + tok.encode(PROMPT)
    ids = tok.encode(c.choices[0].text)
    ref = reference(prompt + ids)[len(prompt) - 1:]
    greedy = [int(np.argmax(ref[i])) for i in range(8)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert np.allclose(lp.token_logprobs, [ref[i, g] for i, g in enumerate(greedy)], atol=1e-3)
    for i, top in enumerate(lp.top_logprobs):
        want = [int(j) for j in np.argsort(-ref[i])[:5]]
        assert {tok.token_bytes(j) for j in want} <= set(top)  # ids whose texts coincide share one entry
        for text, value in top.items():
            assert any(tok.token_bytes(j) == text and abs(ref[i, j] - value) < 1e-3 for j in want), (text, value)
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_echo_with_logprobs_scores_the_prompt_like_pytorch(server, tok):
    c = create(server, max_tokens=4, temperature=0, logprobs=1, echo=True)
    plain = create(server, max_tokens=4, temperature=0)
    choice = c.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    prompt = tok.encode(PROMPT)
    ref = reference([tok.bos_id] + prompt)
    assert len(choice.logprobs.tokens) == len(prompt) + 4
    assert np.allclose(choice.logprobs.token_logprobs[: len(prompt)], [ref[i, t] for i, t in enumerate(prompt)],
                       atol=1e-3)
    assert c.usage.prompt_tokens == len(prompt) and c.usage.completion_tokens == 4
    echoed = create(server, max_tokens=4, temperature=0, echo=True)  # no logprobs: the prompt text, prepended
    assert echoed.choices[0].text == choice.text and echoed.choices[0].logprobs is None


def test_n_sequences_each_equal_the_request_alone_with_its_seed(server):
    many = create(server, max_tokens=10, temperature=1.0, seed=11, n=3)
    alone = [create(server, max_tokens=10, temperature=1.0, seed=11 + i).choices[0].text for i in range(3)]
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.text for ch in many.choices] == alone
    assert len(set(alone)) > 1  # distinct seeds, distinct texts
    assert many.usage.completion_tokens == 30


def test_best_of_returns_the_most_likely_per_token(server):
    best = create(server, max_tokens=10, temperature=1.0, seed=5, best_of=3, logprobs=0)
    scored = [create(server, max_tokens=10, temperature=1.0, seed=5 + i, logprobs=0).choices[0] for i in range(3)]
    means = [np.mean(ch.logprobs.token_logprobs) for ch in scored]
    assert best.choices[0].text == scored[int(np.argmax(means))].text
    assert len(best.choices) == 1 and best.usage.completion_tokens == 30


def test_n_streams_interleaved_with_logprobs_equal_the_whole_answers(server):
    async def run():
        stream = await client(server).completions.create(model="generate", prompt=PROMPT, max_tokens=6,
                                                          temperature=0.8, seed=3, n=2, logprobs=2, stream=True,
                                                          stream_options={"include_usage": True})
        return [chunk async for chunk in stream]
    chunks = server.call(run())
    whole = create(server, max_tokens=6, temperature=0.8, seed=3, n=2, logprobs=2)
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(ch.text for ch in mine) == whole.choices[i].text
        streamed = [lp for ch in mine if ch.logprobs for lp in ch.logprobs.token_logprobs]
        assert streamed == pytest.approx(whole.choices[i].logprobs.token_logprobs, abs=1e-6)
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_logit_bias_and_penalties_steer_the_text(server, tok):
    target = tok.encode(" fox")[0]
    c = create(server, max_tokens=5, temperature=0, logit_bias={str(target): 100})
    assert tok.encode(c.choices[0].text) == [target] * 5 or c.choices[0].text == tok.decode([target] * 5)
    plain = create(server, max_tokens=12, temperature=0).choices[0].text
    penalised = create(server, max_tokens=12, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(set(tok.encode(penalised.choices[0].text))) >= len(set(tok.encode(plain)))


@pytest.mark.parametrize("kw,field", [
    (dict(logprobs=6), "logprobs"), (dict(n=3, best_of=2), "best_of"),
    (dict(best_of=3, stream=True), "best_of"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"99999": 1}), "logit_bias"), (dict(n=5, prompt=[PROMPT] * 2), "n"),
    (dict(presence_penalty=2.5), "presence_penalty"),
])
def test_unsupported_values_are_a_422_naming_the_field(server, kw, field):
    body = {"model": "generate", "prompt": PROMPT, **kw}
    r = server.request("POST", "/v1/completions", json=body)
    assert r.status_code in (413, 422), r.text
    assert field in r.text, r.text
