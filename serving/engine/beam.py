"""Beam search for one request, as pure logic over the logits of its beam rows.

The engine gives a beam-search request `beam_size` KV slots (one per beam) in the same continuous batch as
other requests; each step it passes the logits of those rows here and gets back, per beam, the parent beam
and the new token. Reordering beams is then a KV slot copy (runtime.copy_slots), done by the engine.

The algorithm (fairseq/Hugging Face "early stopping" beam search), which tests/test_beam.py checks against
an independent reference over the PyTorch model:
- scores are summed log-probabilities (log_softmax in float64 of the float32 logits); banned token ids (an
  imported model's bad_words_ids) get -inf after the log_softmax, as Hugging Face's logits processors do;
- the first step expands only beam 0 (all beams hold the same prefix);
- each step ranks the candidates (beam, token) of all live beams by score and takes the best 2k;
  walking them in order, a candidate ending the sequence (eos or a stop id) becomes a finished hypothesis
  if its rank is < k, any other candidate extends a live beam, until k live beams are found;
- the search stops once k hypotheses have finished before the last step (STOP), or after max_new_tokens steps,
  where the live beams join the finished ones, as in Hugging Face's generate, where every top candidate at the
  length limit finishes (the reason is then STOP if the best hypothesis ended with an end token, else LENGTH);
- hypotheses are ranked by score / length ** length_penalty, length counting the generated tokens
  including the final eos; returned tokens exclude the eos.

Does not own: KV slots, the runtime, streaming (serving/engine/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.engine.types import FinishReason

Hypothesis = tuple[tuple[int, ...], float]  # (token ids without eos, normalized score)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(k, V) float32 -> (k, V) float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@dataclass
class BeamSearch:
    """The state of one request's beam search; `advance` once per decoder step."""

    beam_size: int
    max_new_tokens: int
    end_ids: frozenset[int]  # eos and stop token ids
    length_penalty: float = 1.0
    n_best: int = 1
    banned_ids: tuple[int, ...] = ()  # never chosen (set to -inf after the log_softmax)
    beams: list[list[int]] = field(default_factory=lambda: [[]])  # live beams' generated tokens
    scores: np.ndarray = field(default_factory=lambda: np.zeros(1))
    finished: list[tuple[tuple[int, ...], float]] = field(default_factory=list)  # (tokens incl. end, raw)
    steps: int = 0
    reason: FinishReason | None = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def advance(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Consume the logits of the beam rows (k, V) -> (parents (k,), tokens (k,)) for the next step.

        Row i of `logits` belongs to live beam i (on the first step only row 0 is read). When the search
        is done after this step, the returned arrays are still valid but will not be run.
        """
        k = self.beam_size
        logp = log_softmax(logits[: len(self.beams)])
        if self.banned_ids:
            logp[:, list(self.banned_ids)] = -np.inf
        cand = (self.scores[:, None] + logp).ravel()  # (nb * V,)
        # 2k candidates with one end token (k * (1 + #end ids) in general) always hold k that continue.
        n = min(k * (1 + len(self.end_ids)), cand.shape[0])
        top = np.argpartition(-cand, n - 1)[:n]
        top = top[np.lexsort((top, -cand[top]))]  # best first; ties -> lower index first
        v = logp.shape[1]
        parents, tokens, scores, beams = [], [], [], []
        for rank, idx in enumerate(top):
            b, tok, s = int(idx // v), int(idx % v), float(cand[idx])
            if tok in self.end_ids:
                if rank < k:
                    self.finished.append((tuple(self.beams[b]) + (tok,), s))
            else:
                parents.append(b)
                tokens.append(tok)
                scores.append(s)
                beams.append(self.beams[b] + [tok])
            if len(beams) == k:
                break
        self.steps += 1
        self.beams, self.scores = beams, np.asarray(scores, dtype=np.float64)
        if self.steps >= self.max_new_tokens:
            # every live beam finishes too (Hugging Face's generate: each top candidate at the limit is done)
            self.finished.extend((tuple(t), float(s)) for t, s in zip(self.beams, self.scores, strict=True))
            best = self.hypotheses_raw()[0][0]
            self.reason = FinishReason.STOP if best and best[-1] in self.end_ids else FinishReason.LENGTH
        elif len(self.finished) >= k:
            self.reason = FinishReason.STOP
        return np.asarray(parents, dtype=np.int64), np.asarray(tokens, dtype=np.int64)

    def hypotheses_raw(self) -> list[tuple[tuple[int, ...], float]]:
        """Every finished hypothesis, best first: (tokens with their end token, normalized score)."""
        ranked = [(toks, raw / (len(toks) ** self.length_penalty)) for toks, raw in self.finished]
        ranked.sort(key=lambda h: -h[1])  # stable: earlier-finished first on ties
        return ranked

    def hypotheses(self) -> tuple[Hypothesis, ...]:
        """The n-best finished hypotheses, best first: (tokens without the end token, normalized score)."""
        return tuple(
            (toks[:-1] if toks and toks[-1] in self.end_ids else toks, norm)
            for toks, norm in self.hypotheses_raw()[: self.n_best]
        )
