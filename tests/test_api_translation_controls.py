"""The translation API's controls on the real engine of a tiny translator (tests/inprocess_app.py), held to PyTorch.

The acceptance: a forced prefix is kept verbatim and the continuation equals PyTorch's greedy continuation of that
prefix; a scored translation's log-probability equals PyTorch's within 1e-3; a 20-sentence document comes back as
20 translations in order, each equal to that sentence alone; return_scores, min_tokens and no_repeat_ngram_size.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_bundle import cached_bundle
from export.bundle import load_bundle
from inprocess_app import InProcessServer
from model.tokenizer import Tokenizer
from serving.server.config import Limits
from serving.server.translation import join_sentences, split_sentences

LIMITS = Limits(max_prompt_tokens=40, max_tokens=20, default_max_tokens=12, max_texts=24)
SOURCE = "the quick brown fox"


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(LIMITS, max_waiting=32)  # a split document's sentences arrive at once
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(load_bundle(cached_bundle("translate")[0]).tokenizer_path)


@torch.no_grad()
def logprobs(src: list[int], decoder_in: list[int]) -> np.ndarray:
    model = cached_bundle("translate")[1]
    logits = model(torch.tensor([src]), torch.tensor([len(src)]), torch.tensor([decoder_in]))
    return torch.log_softmax(logits.double(), -1)[0].numpy()


def translate(server: InProcessServer, **body) -> dict:
    r = server.request("POST", "/v1/translate", json={"text": SOURCE, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_forced_prefix_is_kept_and_the_rest_is_pytorch_greedy(server, tok):
    prefix = "fox the"
    out = translate(server, target_prefix=prefix, max_tokens=8)["translations"][0]
    assert out["text"].startswith(prefix)
    src, ids = tok.encode(SOURCE), tok.encode(prefix)
    for _ in range(8):  # PyTorch's greedy continuation of the prefix
        nxt = int(np.argmax(logprobs(src, [tok.bos_id] + ids)[-1]))
        if nxt == tok.eos_id:
            break
        ids.append(nxt)
    assert out["text"] == tok.decode(ids)


def test_a_scored_translation_equals_pytorch_log_probability(server, tok):
    target = "the lazy dog"
    r = server.request("POST", "/v1/translate/score", json={"text": [SOURCE, "over"], "target": [target, "dog"]})
    assert r.status_code == 200, r.text
    got = r.json()["scores"]
    for (src, tgt), s in zip([(SOURCE, target), ("over", "dog")], got):
        ids = tok.encode(tgt) + [tok.eos_id]
        ref = logprobs(tok.encode(src), [tok.bos_id] + ids[:-1])
        want = [ref[i, t] for i, t in enumerate(ids)]
        assert s["score"] == pytest.approx(sum(want), abs=1e-3)
        assert [t["logprob"] for t in s["token_scores"]] == pytest.approx(want, abs=1e-3)
        assert s["token_scores"][-1]["token"] == "</s>"


def test_return_scores_sum_the_greedy_tokens_log_probabilities(server, tok):
    out = translate(server, return_scores=True, max_tokens=10)["translations"][0]
    scored = server.request("POST", "/v1/translate/score", json={"text": SOURCE, "target": out["text"]}).json()
    if out["finish_reason"] == "stop":  # the same tokens, the end token included: the same log-probability
        assert out["score"] == pytest.approx(scored["scores"][0]["score"], abs=1e-3)
    assert out["score"] == pytest.approx(sum(t["logprob"] for t in out["token_scores"]), abs=1e-9)
    r = server.request("POST", "/v1/translate", json={"text": SOURCE, "return_scores": True, "beam_size": 2})
    assert r.status_code == 422 and "return_scores" in r.text


def test_a_20_sentence_document_comes_back_in_order_each_as_alone(server):
    words = ["the quick fox", "the lazy dog", "over the fox", "quick brown dog", "the dog jumps"]
    sentences = [f"{words[i % 5]} {i}." if i % 3 else f"{words[i % 5]}!" for i in range(20)]
    document = " ".join(sentences[:10]) + "\n\n" + " ".join(sentences[10:])
    out = translate(server, text=document, split_sentences=True, max_tokens=10)["translations"][0]
    alone = server.request("POST", "/v1/translate", json={"text": sentences, "max_tokens": 10}).json()
    assert out["sentences"] == [t["text"] for t in alone["translations"]]
    assert len(out["sentences"]) == 20
    assert out["text"] == " ".join(out["sentences"][:10]) + "\n\n" + " ".join(out["sentences"][10:])


def test_split_and_join_keep_the_documents_whitespace():
    text = 'He said "Go." Then left!  Really?\nYes. '
    parts, gaps = split_sentences(text)
    assert parts == ['He said "Go."', "Then left!", "Really?", "Yes."] and gaps == [" ", "  ", "\n"]
    assert join_sentences(parts, gaps) == text.rstrip()
    assert split_sentences("no end") == (["no end"], [])


def test_min_tokens_and_no_repeat_ngram_size(server, tok):
    out = translate(server, text="over", min_tokens=6, max_tokens=12)["translations"][0]
    assert len(tok.encode(out["text"])) >= 6 or out["finish_reason"] == "length"
    out = translate(server, no_repeat_ngram_size=1, max_tokens=12)["translations"][0]
    ids = tok.encode(out["text"])
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("body,field", [
    ({"text": ["a", "b"], "target_prefix": "x"}, "target_prefix"),
    ({"text": "a. b.", "split_sentences": True, "target_prefix": "x"}, "split_sentences"),
    ({"text": ". ".join(["a"] * 30), "split_sentences": True}, "text"),
])
def test_bad_controls_are_refused_naming_the_field(server, body, field):
    r = server.request("POST", "/v1/translate", json=body)
    assert r.status_code in (413, 422) and field in r.text, r.text
