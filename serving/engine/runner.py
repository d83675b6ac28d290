"""The step runner: executes a StepPlan on the ModelRuntime and picks each row's next token.

Runs in the engine's step thread (ONNX Runtime releases the GIL, the event loop keeps serving). Owns the
per-slot decode inputs (last token, cached length) as numpy arrays so that building a decode step is a
slice, not a Python loop; the slot copies (compaction moves, beam reorders) on the runtime and on those
arrays; the encoder run for joiners, the decode call on rows [0, D) and the prefill call on the joiners'
rows [D, D + n) (one call for both when every joiner prefills a single token, as translation joiners do);
the batched argmax of plain greedy rows, per-row sampling and beam advances; the runtime's banned token ids
(an imported model's bad_words_ids) get -inf before greedy and sampling, and after the log_softmax in beam search
(serving/engine/beam.py), as Hugging Face's generate applies them.

Does not own: which rows run (serving/engine/scheduler.py), events, finishing requests (serving/engine/engine.py).
Everything it touches belongs to the step in flight; only the step thread calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol

import numpy as np

from serving.engine.beam import BeamSearch
from serving.engine.sampling import adjust_logits, greedy, log_softmax, sample_plain, sample_row, top_logprobs
from serving.engine.scheduler import HELD, Chunk, Phase, Sequence, StepPlan
from serving.engine.types import GenerationRequest


class Runtime(Protocol):
    """The part of serving.engine.runtime.ModelRuntime the engine uses."""

    is_encoder_decoder: bool
    n_slots: int
    max_len: int
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, start: int, sources: list[list[int]]) -> None: ...
    def keep_sources(self, n: int) -> None: ...
    def step(
        self, start: int, input_ids: np.ndarray, input_len: np.ndarray, write_pos: np.ndarray, copy: bool = True
    ) -> np.ndarray: ...
    def copy_slots(self, src: Seq[int], dst: Seq[int], length: int | None = None) -> None: ...


@dataclass(eq=False)
class RequestState:
    """The engine's per-request state (Sequence.payload)."""

    req: GenerationRequest
    handle: Any  # serving.engine.handle.RequestHandle, set by serving.engine.checks.admit
    decoder_prompt: list[int]  # decoder-only: the prompt; encoder-decoder: [bos]
    source: list[int]  # encoder-decoder: the source sentence; decoder-only: []
    end_ids: frozenset[int]
    plain: bool  # plain greedy: the batched argmax is its token
    sampled: bool = False  # plain temperature sampling: the step's batched sample_plain gives its token
    adjusts: bool = False  # penalties, biases, min_tokens or no_repeat_ngram_size change its logits
    # anything beyond picking a token: log-probabilities, forced tokens or adjusted logits (`_Extras`)
    extra: bool = False
    rng: np.random.Generator | None = None
    beam: BeamSearch | None = None
    beam_tokens: np.ndarray | None = None  # each beam's newest token (fed at the next step)
    tokens: list[int] = field(default_factory=list)
    submitted: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    def generator(self) -> np.random.Generator:
        """Its random generator: every request that is neither plain greedy nor a beam search has one."""
        assert self.rng is not None, "a plain greedy or beam-search request draws no random numbers"
        return self.rng

    def forcing(self) -> bool:
        """Whether its next token is a forced one (SamplingParams.forced_ids)."""
        return len(self.tokens) < len(self.req.params.forced_ids)

    def history(self) -> np.ndarray:
        """Ids the repetition penalty applies to: the prompt (decoder-only) and the generated tokens."""
        base = self.decoder_prompt if len(self.decoder_prompt) > 1 else []
        return np.asarray(base + self.tokens, dtype=np.int64)


@dataclass
class StepResult:
    """Per request that produced something this step: its token (with its log-probabilities when asked: (logprob,
    top ids and theirs)), or its beam step (parents, tokens)."""

    tokens: list[tuple[Sequence, int, tuple | None]] = field(default_factory=list)
    beams: list[Sequence] = field(default_factory=list)
    decode_tokens: int = 0
    prefill_tokens: int = 0


class StepRunner:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        n = runtime.n_slots
        self.last = np.zeros(n, dtype=np.int64)  # token each slot feeds next
        self.pos = np.zeros(n, dtype=np.int64)  # tokens cached in each slot = its next write position
        self.ones = np.ones(n, dtype=np.int64)
        # Slot copies not yet applied, in order: (moves, whether the slot inputs move too). Compaction moves
        # carry a row's next token and position along; beam reorders copy the KV only, since each new beam's
        # token is already in place.
        self.pending: list[tuple[list[tuple[int, int]], bool]] = []
        self._reorders: list[tuple[int, int]] = []  # this step's beam reorders
        self._launched: Callable[[], None] | None = None  # this step's start signal, not yet given
        self.banned = np.asarray(getattr(runtime, "banned_ids", ()), dtype=np.int64)

    def _ban(self, logits: np.ndarray) -> np.ndarray | None:
        """Set the banned columns to -inf in place; returns their raw values (for beam search) or None."""
        if not self.banned.size:
            return None
        raw = logits[:, self.banned].copy()
        logits[:, self.banned] = -np.inf
        return raw

    def _raw_rows(self, logits: np.ndarray, raw: np.ndarray | None, rows: Seq[int] | slice) -> np.ndarray:
        """Rows of the logits as the model gave them (banned columns restored): beam search bans after its
        log_softmax."""
        out = logits[rows]
        if raw is not None:
            out = out.copy()
            out[:, self.banned] = raw[rows]
        return out

    def queue_moves(self, batches: list[list[tuple[int, int]]]) -> None:
        self.pending.extend((b, True) for b in batches if b)

    def _starting(self) -> None:
        """Give the step's start signal once, just before its first ONNX Runtime call (which releases the GIL)."""
        if self._launched is not None:
            launched, self._launched = self._launched, None
            launched()

    def _apply_copies(self) -> None:
        for batch, with_inputs in self.pending:
            src = [s for s, _ in batch]
            dst = [d for _, d in batch]
            # live cache positions of the sources (+1: pos stops at max_len - 1 on a full row)
            self.rt.copy_slots(src, dst, length=int(self.pos[src].max()) + 1)
            if with_inputs:
                self.last[dst] = self.last[src]
                self.pos[dst] = self.pos[src]
        self.pending = []

    def execute(self, plan: StepPlan, rows: list[Sequence], launched: Callable[[], None] | None = None) -> StepResult:
        """Run one step: copies, decode rows [0, D) (`rows` = their owners), then the prefill rows.

        Prefill rows of one token each (every translation joiner: its decoder starts from bos) share the
        decode call, rows [0, D + n); longer prefill runs as a second call on rows [D, D + n). `launched` is
        called once, just before the first ONNX Runtime call (the engine then delivers the last step's events).
        """
        self._launched = launched
        try:
            return self._execute(plan, rows)
        finally:
            self._starting()  # a step that failed before computing still gives the signal

    def _execute(self, plan: StepPlan, rows: list[Sequence]) -> StepResult:
        self._apply_copies()
        if self.rt.is_encoder_decoder:  # after the moves, every live source is in rows [0, D): joiners follow
            self.rt.keep_sources(plan.decode_rows)
        out = StepResult()
        self._reorders = []
        d, prefill = plan.decode_rows, None
        if plan.prefill:
            prefill = self._prefill_inputs(plan)  # (ids (n, T), lens, wpos); encodes the joiners' sources
            out.prefill_tokens = int(prefill[1].sum())
        self._starting()
        decode_logits: np.ndarray | None = None  # (D, V), when there are decode rows
        prefill_logits: np.ndarray | None = None  # (n, V), when there is a prefill
        if prefill is not None and prefill[0].shape[1] == 1 and d:
            ids = np.concatenate([self.last[:d, None], prefill[0]])
            wpos = np.concatenate([self.pos[:d], prefill[2]])
            logits = self.rt.step(0, ids, self.ones[: ids.shape[0]], wpos, copy=False)  # (D + n, V)
            decode_logits, prefill_logits = logits[:d], logits[d:]
        else:
            # copy=False: each call's logits are the runtime's rows [start, start + n), disjoint, read this step
            if d:
                decode_logits = self.rt.step(0, self.last[:d, None], self.ones[:d], self.pos[:d], copy=False)
            if prefill is not None:
                prefill_logits = self.rt.step(d, *prefill, copy=False)
        if decode_logits is not None:
            self._pick_decode(decode_logits, rows, out)
            self.pos[:d] = np.minimum(self.pos[:d] + 1, self.rt.max_len - 1)
        if prefill is not None and prefill_logits is not None:
            self.pos[d : d + prefill[0].shape[0]] = prefill[2] + prefill[1]
            self._pick_prefill(prefill_logits, d, plan.prefill, out)
        if self._reorders:
            self.pending.append((self._reorders, False))
        return out

    def _pick_decode(self, logits: np.ndarray, rows: list[Sequence], out: StepResult) -> None:
        raw = self._ban(logits)
        out.decode_tokens = len(rows)
        # the common case: every row plain greedy with nothing extra, its token the batched argmax, no per-row work
        if all(s.payload.plain and not s.payload.extra and s.phase is not HELD for s in rows):
            tokens = greedy(logits)
            self.last[: len(rows)] = tokens
            out.tokens = list(zip(rows, tokens.tolist(), repeat(None)))
            return
        extras = _Extras(
            logits, [(r, s.payload) for r, s in enumerate(rows) if s.phase != Phase.HELD and s.payload.extra]
        )
        tokens = greedy(logits)  # (D,): every plain-greedy row is done here, in one call
        _sample_rows(
            logits,
            tokens,
            [
                (r, s.payload)
                for r, s in enumerate(rows)
                if s.phase != Phase.HELD and s.payload.sampled and not s.payload.forcing()
            ],
        )
        for r, seq in enumerate(rows):
            if seq.phase == Phase.HELD:
                continue
            st: RequestState = seq.payload
            if st.beam is not None:
                if seq.slots[0] == r:  # once per beam request, at its first row
                    self._advance_beam(seq, self._raw_rows(logits, raw, seq.slots))
                    out.beams.append(seq)
                continue
            if not st.plain and not st.sampled and not st.forcing():
                tokens[r] = sample_row(logits[r], st.req.params, st.generator(), st.history())
            tokens[r], info = extras.finish(r, st, int(tokens[r]))
            out.tokens.append((seq, int(tokens[r]), info))
        self.last[: len(rows)] = tokens  # held rows (static batch) feed junk, which nothing reads
        for seq in out.beams:
            self.last[seq.slots] = seq.payload.beam_tokens

    def _advance_beam(self, seq: Sequence, logits: np.ndarray, reorder: bool = True) -> None:
        """One beam step; beam i's KV slot gets its parent's cache (a slot copy, before the next step)."""
        st: RequestState = seq.payload
        beam = st.beam
        assert beam is not None, "a beam step of a request without beams"
        parents, st.beam_tokens = beam.advance(logits)
        if reorder and not beam.done:
            # every beam request's reorder goes into one copy batch: their slot sets are disjoint
            self._reorders += [(seq.slots[p], seq.slots[i]) for i, p in enumerate(parents) if p != i]

    def _prefill_inputs(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The prefill rows' (input_ids (n, T) right-padded, input_len, write_pos); runs the encoder first."""
        chunks = plan.prefill
        n = sum(c.seq.width for c in chunks)
        t = max(c.length for c in chunks)
        ids = np.full((n, t), self.rt.pad_id, dtype=np.int64)
        lens = np.empty(n, dtype=np.int64)
        wpos = np.empty(n, dtype=np.int64)
        sources: list[list[int]] = []
        r = 0
        for c in chunks:
            st: RequestState = c.seq.payload
            ids[r : r + c.seq.width, : c.length] = st.decoder_prompt[c.start : c.start + c.length]
            lens[r : r + c.seq.width], wpos[r : r + c.seq.width] = c.length, c.start
            if self.rt.is_encoder_decoder:
                sources += [st.source] * c.seq.width
            r += c.seq.width
        if sources:
            self._starting()
            self.rt.encode(plan.prefill_start, sources)
        return ids, lens, wpos

    def _pick_prefill(self, logits: np.ndarray, start: int, chunks: list[Chunk], out: StepResult) -> None:
        raw = self._ban(logits)
        firsts, r = [], 0  # each chunk's first row
        for c in chunks:
            firsts.append(r)
            r += c.seq.width
        done = [
            (r, c.seq.payload)
            for r, c in zip(firsts, chunks, strict=True)
            if c.completes and c.seq.payload.beam is None
        ]
        extras = _Extras(logits, [(r, st) for r, st in done if st.extra])
        tokens = greedy(logits)
        _sample_rows(logits, tokens, [(r, st) for r, st in done if st.sampled and not st.forcing()])
        r = 0
        for c in chunks:
            seq, st = c.seq, c.seq.payload
            if c.completes:
                if st.beam is not None:
                    # after prefill every beam row holds the same cache: no reorder copies needed
                    self._advance_beam(seq, self._raw_rows(logits, raw, slice(r, r + 1)), reorder=False)
                    self.last[start + r : start + r + seq.width] = st.beam_tokens
                    out.beams.append(seq)
                else:
                    tok = (
                        int(tokens[r])
                        if st.plain or st.sampled or st.forcing()
                        else sample_row(logits[r], st.req.params, st.rng, st.history())
                    )
                    tok, info = extras.finish(r, st, tok)
                    self.last[start + r] = tok
                    out.tokens.append((seq, tok, info))
            r += seq.width


def _sample_rows(logits: np.ndarray, tokens: np.ndarray, rows: list[tuple[int, RequestState]]) -> None:
    """tokens[r] for every plain-sampling row r, in one batched call (each request draws one uniform from its
    own generator, so its tokens do not depend on its batch-mates)."""
    if not rows:
        return
    idx = np.fromiter((r for r, _ in rows), dtype=np.int64, count=len(rows))
    temps = np.fromiter((st.req.params.temperature for _, st in rows), dtype=np.float64, count=len(rows))
    draws = np.fromiter((st.generator().random() for _, st in rows), dtype=np.float64, count=len(rows))
    tokens[idx] = sample_plain(logits[idx], temps, draws)


class _Extras:
    """A step's rows that ask for more than a token: their log-probabilities are taken from the logits as the
    model gave them (banned ids excluded), before their penalties and biases change those logits in place (then
    greedy and sampling pick from the changed ones); `finish` puts a forced token in place of the picked one and
    gives the token's log-probabilities."""

    def __init__(self, logits: np.ndarray, rows: list[tuple[int, RequestState]]) -> None:
        self.rows = rows
        asked = [r for r, st in rows if st.req.params.logprobs is not None]
        self.logprobs = dict(zip(asked, log_softmax(logits[asked]), strict=True)) if asked else {}
        for r, st in rows:
            if st.adjusts:
                adjust_logits(logits[r], st.req.params, st.tokens, st.decoder_prompt + st.tokens, st.end_ids)

    def finish(self, r: int, st: RequestState, token: int) -> tuple[int, tuple | None]:
        if not st.extra:
            return token, None
        forced = st.req.params.forced_ids
        if len(st.tokens) < len(forced):
            token = forced[len(st.tokens)]
        lp, k = self.logprobs.get(r), st.req.params.logprobs  # lp: only for a request that asked (k set)
        if lp is None or k is None:
            return token, None
        return token, (float(lp[token]), top_logprobs(lp, k))
