"""Banned token ids (an imported Marian model's bad_words_ids, the bundle's generation.banned_ids).

The engine never generates them: greedy and sampled rows see -inf there, and beam search bans them after its
log_softmax, so its scores keep the banned tokens' probability mass as Hugging Face's generate does.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine_bundle import cached_bundle
from engine_util import run_all, tokens
from serving.engine.beam import BeamSearch, log_softmax
from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.runtime import ModelRuntime
from serving.engine.types import GenerationRequest, SamplingParams
from export.bundle import load_bundle


def test_beam_search_bans_after_the_log_softmax():
    logits = np.array([[0.0, 1.0, 2.0, 10.0]], np.float32)
    beam = BeamSearch(beam_size=2, max_new_tokens=5, end_ids=frozenset({0}), banned_ids=(3,))
    parents, toks = beam.advance(logits)
    assert toks.tolist() == [2, 1]  # 3 would be best: banned
    np.testing.assert_allclose(beam.scores, log_softmax(logits)[0, [2, 1]])  # not renormalised without 3
    assert beam.scores[0] < -7.9


class BannedRuntime:
    """A ModelRuntime that reports banned ids, as one of an imported bundle does."""

    def __init__(self, rt: ModelRuntime, banned: tuple[int, ...]) -> None:
        self._rt, self.banned_ids = rt, banned

    def __getattr__(self, name):
        return getattr(self._rt, name)


async def _outputs(banned: tuple[int, ...], params: SamplingParams) -> list[list[int]]:
    bundle, _ = cached_bundle("translate")
    rt = BannedRuntime(ModelRuntime(load_bundle(bundle), 16, provider="cpu"), banned)
    engine = Engine(rt, EngineConfig(max_slots=16))
    await engine.start()
    try:
        reqs = [GenerationRequest(f"r{i}", [5 + i, 17, 40 + 3 * i, 9], params) for i in range(8)]
        if params.beam_size == 1:
            return [tokens(ev) for ev in await run_all(engine, reqs)]
        out = []
        for r in reqs:  # beams: the best hypothesis of each
            events = (await run_all(engine, [r]))[0]
            out.append(list(events[-1].hypotheses[0][0]))
        return out
    finally:
        await engine.stop()


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=12),
                                    SamplingParams(max_new_tokens=12, temperature=1.0, seed=3),
                                    SamplingParams(max_new_tokens=12, beam_size=3)])
async def test_the_engine_never_generates_a_banned_id(params):
    free = await _outputs((), params)
    common = Counter(t for row in free for t in row).most_common(1)[0][0]
    banned = await _outputs((common,), params)
    assert all(common not in row for row in banned)
    assert banned != free
