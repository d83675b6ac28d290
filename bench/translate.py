"""`kvserve bench`, translation: our engine (in-process, ONNX Runtime) vs CTranslate2 on the same weights.

Both translate the same test-split sentences greedily with the same maximum output length and the same
intra-op thread count, at concurrency (ours) = batch size (CTranslate2) 1, 8 and 32:
- ours: C clients in a closed loop over one continuous-batching Engine (each sends its next sentence as
  soon as the last one is done); a sentence's latency is submit -> last token.
- CTranslate2: `Translator.translate_batch` on consecutive chunks of C sentences (what a server gathering C
  requests would run); every sentence of a chunk has that call's wall time as its latency.
The systems alternate within every round (the order flips each round), the figures are medians over
rounds, and the outputs are compared token for token (% identical) and, where the test split gives
references, scored with chrF.

Does not measure: HTTP or Ray Serve (bench/http.py), beam search (both decode greedily), or quality beyond
the share of identical outputs and chrF against the references.
Owns this comparison only. The CTranslate2 model is converted by `kvserve export --format ctranslate2`
(export/ctranslate2_convert.py, run by bench/cli.py as a subprocess); no torch here.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Sentences:
    texts: list[str]
    references: list[str] | None  # German references, when the test split was found
    source: str


def load_sentences(data_dir: Path, n: int, seed: int = 0) -> Sentences:
    """n test-split English sentences (a seeded sample, in split order); the built-in list if no data."""
    from loadtest.workloads import FALLBACK_SENTENCES
    from model import data

    try:
        pairs = [(en, de) for en, de in data.load_pairs(data_dir, "test") if en.strip()]
    except (OSError, data.DataError):
        pairs = []
    if not pairs:
        texts = [FALLBACK_SENTENCES[i % len(FALLBACK_SENTENCES)] for i in range(n)]
        return Sentences(texts, None, f"built-in list of {len(FALLBACK_SENTENCES)} sentences "
                                      f"({data_dir}/translate is not prepared)")
    keep = sorted(np.random.default_rng(seed).choice(len(pairs), size=min(n, len(pairs)), replace=False))
    return Sentences([pairs[i][0] for i in keep], [pairs[i][1] for i in keep],
                     f"{len(keep)} of the {len(pairs)} sentences of {data_dir}/translate test split (seeded sample)")


@dataclass
class RunResult:
    outputs: list[list[int]]  # token ids per sentence, without bos/eos
    latencies: list[float]
    wall_s: float
    rows_per_step: float | None = None  # ours: the engine's mean rows per step over the run
    clock: dict[str, float] | None = None  # ours: seconds in ORT per graph over the run (bench/breakdown.py)

    def summary(self) -> dict[str, float]:
        tokens = sum(len(o) for o in self.outputs)
        out = {"rows_per_step": self.rows_per_step} if self.rows_per_step is not None else {}
        if self.clock is not None:  # where a sentence's time goes, ms: ORT's decoder, its encoder, all the rest
            per = 1e3 / len(self.outputs)
            dec, enc = self.clock["ort decoder"], self.clock["ort encoder"]
            out |= {"ms_decoder": dec * per, "ms_encoder": enc * per, "ms_other": (self.wall_s - dec - enc) * per}
        return {**out, "sentences_per_s": len(self.outputs) / self.wall_s, "tokens_per_s": tokens / self.wall_s,
                "latency_p50_s": float(np.percentile(self.latencies, 50)),
                "latency_p99_s": float(np.percentile(self.latencies, 99)), "wall_s": self.wall_s,
                "output_tokens": tokens}


async def run_ours(engine: Any, sources: list[list[int]], concurrency: int, max_new: int, tag: str,
                   steps: list[int] | None = None, clock: dict[str, float] | None = None) -> RunResult:
    """Closed loop: `concurrency` clients over the sentences, greedy, continuous batching. `steps`: the rows of
    every engine step (an observer appends them), for the run's mean rows per step; `clock`: the engine's ORT
    clocks (bench/breakdown.py `instrument`), for the run's split of a sentence's time."""
    from serving.engine.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    outputs: list[list[int]] = [[] for _ in sources]
    latencies = [0.0] * len(sources)
    todo = list(range(len(sources)))[::-1]

    async def client() -> None:
        while todo:
            i = todo.pop()
            t0 = time.perf_counter()
            async for ev in engine.submit(GenerationRequest(f"{tag}-{i}", sources[i], params)):
                if ev.token_id is not None:
                    outputs[i].append(ev.token_id)
                elif ev.error:
                    raise RuntimeError(f"engine failed on sentence {i}: {ev.error}")
            latencies[i] = time.perf_counter() - t0

    first_step = len(steps) if steps is not None else 0
    before = dict(clock) if clock is not None else None
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    rows = steps[first_step:] if steps is not None else []
    spent = {k: v - before[k] for k, v in clock.items()} if clock is not None and before is not None else None
    return RunResult(outputs, latencies, wall, sum(rows) / len(rows) if rows else None, spent)


def run_ct2(translator: Any, sources: list[list[str]], vocab: dict[str, int], batch: int, max_new: int) -> RunResult:
    """Consecutive chunks of `batch` sentences through translate_batch, greedy."""
    outputs: list[list[int]] = []
    latencies: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(sources), batch):
        chunk = sources[start:start + batch]
        c0 = time.perf_counter()
        res = translator.translate_batch(chunk, beam_size=1, max_decoding_length=max_new)
        took = time.perf_counter() - c0
        outputs += [[vocab[t] for t in r.hypotheses[0]] for r in res]
        latencies += [took] * len(chunk)
    return RunResult(outputs, latencies, time.perf_counter() - t0)


def identical_share(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def chrf(hypotheses: list[str], references: list[str] | None) -> float | None:
    if not references:
        return None
    import sacrebleu

    return round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2)


def _median_summary(runs: list[RunResult]) -> dict[str, float]:
    sums = [r.summary() for r in runs]
    return {k: statistics.median(s[k] for s in sums) for k in sums[0]}


async def _compare(bundle: Path, ct2_dir: Path, sentences: Sentences, concurrencies: list[int], rounds: int,
                   threads: int, max_new: int, ct2_compute_type: str) -> dict[str, Any]:
    import ctranslate2

    from bench.breakdown import instrument
    from model.tokenizer import Tokenizer
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    slots = max(concurrencies)
    engine = Engine.from_bundle(bundle, EngineConfig(max_slots=slots, max_waiting=4 * slots, provider="cpu",
                                                     intra_op_threads=threads, max_new_tokens=max_new))
    tok = Tokenizer.load(bundle / "tokenizer.json")
    src_ids = [tok.encode(t)[: engine.request_limits.max_src_len] or [tok.pad_id] for t in sentences.texts]
    vocab_list = [tok.hf.id_to_token(i) or f"<unused_{i}>" for i in range(engine.vocab_size)]
    src_tokens = [[vocab_list[i] for i in ids] for ids in src_ids]
    vocab = {t: i for i, t in enumerate(vocab_list)}
    # "fp32" -> float32 (the converted weights as they are); "int8" -> int8 (8-bit weights and int8 GEMMs)
    compute_type = {"fp32": "float32"}.get(ct2_compute_type, ct2_compute_type)
    translator = ctranslate2.Translator(str(ct2_dir), device="cpu", intra_threads=threads, inter_threads=1,
                                        compute_type=compute_type)
    steps: list[int] = []
    engine.add_observer(lambda s: steps.append(s.batch_size), None)
    clock = instrument(engine)
    await engine.start()
    try:
        warm = min(len(src_ids), 8)  # warm both up (thread pools, first allocations) before timing
        await run_ours(engine, src_ids[:warm], min(warm, slots), max_new, "warm")
        run_ct2(translator, src_tokens[:warm], vocab, warm, max_new)
        rows: list[dict[str, Any]] = []
        first: list[list[int]] | None = None  # our outputs at the first concurrency: batching must not change them
        for c in concurrencies:
            ours: list[RunResult] = []
            theirs: list[RunResult] = []
            for rnd in range(rounds):
                order = ("ours", "ct2") if rnd % 2 == 0 else ("ct2", "ours")
                for system in order:
                    if system == "ours":
                        ours.append(await run_ours(engine, src_ids, c, max_new, f"c{c}-r{rnd}", steps, clock))
                    else:
                        theirs.append(run_ct2(translator, src_tokens, vocab, c, max_new))
            first = first if first is not None else ours[0].outputs
            rows.append(_row(c, ours, theirs, tok, sentences.references, first))
    finally:
        await engine.stop()
    return {"sentences": len(src_ids), "source": sentences.source, "max_new_tokens": max_new, "threads": threads,
            "ct2_compute_type": compute_type,
            "rounds": rounds, "concurrency": concurrencies, "rows": rows,
            "ours_batch_invariant": all(r["ours_same_as_first"] for r in rows)}


def _row(c: int, ours: list[RunResult], theirs: list[RunResult], tok: Any, refs: list[str] | None,
         first: list[list[int]]) -> dict[str, Any]:
    o, t = _median_summary(ours), _median_summary(theirs)
    return {"concurrency": c, "ours": o, "ct2": t,
            "throughput_ratio": o["sentences_per_s"] / t["sentences_per_s"],
            "latency_p50_ratio": o["latency_p50_s"] / t["latency_p50_s"],
            "identical": identical_share(ours[0].outputs, theirs[0].outputs),
            "ours_same_as_first": ours[0].outputs == first,
            "ours_stable_over_rounds": all(r.outputs == ours[0].outputs for r in ours),
            "chrf_ours": chrf([tok.decode(x) for x in ours[0].outputs], refs),
            "chrf_ct2": chrf([tok.decode(x) for x in theirs[0].outputs], refs)}


def compare(bundle: Path, ct2_dir: Path, sentences: Sentences, concurrencies: list[int], rounds: int,
            threads: int, max_new: int, ct2_compute_type: str = "fp32") -> dict[str, Any]:
    """Run the side-by-side comparison; returns the section's JSON. `ct2_compute_type`: fp32 or int8 (the
    CTranslate2 model at `ct2_dir` converted with that quantization)."""
    return asyncio.run(_compare(bundle, ct2_dir, sentences, concurrencies, rounds, threads, max_new,
                                ct2_compute_type))
