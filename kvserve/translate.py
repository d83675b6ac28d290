"""`kvserve translate`: offline batch translation of a file through the continuous engine, in-process.

    kvserve translate BUNDLE [--beam-size N] [--max-tokens N] [--slots N] < sources.txt > translations.txt

One sentence per line in, one translation per line out, in the input's order (what CTranslate2's
`translate_batch` is used for). Every line is submitted to one Engine (serving/engine/) as a request of its own,
so the continuous batch stays full; a translation is written as soon as every line before it is done. A progress
bar goes to stderr. Works for any translation bundle, kvserve's own or imported (`kvserve import marian`).

A line longer than the model's source limit is cut to it (with a warning naming the line). The tokens are the
same as `/v1/translate` gives for that line (same engine, same tokenizer, same decoding).

Owns: reading lines, the in-flight window, ordered output, the progress bar. Needs the `serve` extra
(onnxruntime), not torch.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, TextIO

from serving.engine.config import EngineConfig
from serving.engine.types import GenerationRequest, SamplingParams


def source_ids(tok: Any, text: str, limit: int, line_no: int, warn: TextIO) -> list[int]:
    """The source's ids as the service encodes them (an empty source is one pad), cut to `limit` tokens."""
    ids = tok.encode(text) or [tok.pad_id]
    if len(ids) > limit:
        print(f"kvserve translate: line {line_no} has {len(ids)} tokens; the model takes {limit}: cut to "
              f"{limit}", file=warn)
        ids = ids[: limit - 1] + [ids[-1]] if ids[-1] == tok.eos_id else ids[:limit]
    return ids


async def _one(engine: Any, request_id: str, ids: list[int], params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for ev in engine.submit(GenerationRequest(request_id, ids, params)):
        if ev.token_id is not None:
            tokens.append(ev.token_id)
        elif ev.error:
            raise RuntimeError(f"request {request_id} failed: {ev.error}")
        elif ev.hypotheses:
            tokens = list(ev.hypotheses[0][0])
    return tokens


async def translate_lines(engine: Any, tok: Any, lines: Iterable[str], params: SamplingParams, window: int,
                          warn: TextIO = sys.stderr) -> AsyncIterator[str]:
    """Translations of `lines`, in order; at most `window` requests in flight at once."""
    limit = engine.request_limits.max_src_len
    pending: dict[int, asyncio.Task] = {}
    it: Iterator[tuple[int, str]] = enumerate(lines)
    next_out, exhausted = 0, False
    while True:
        while not exhausted and len(pending) < window:
            item = next(it, None)
            if item is None:
                exhausted = True
                break
            i, text = item
            ids = source_ids(tok, text, limit, i + 1, warn)
            pending[i] = asyncio.ensure_future(_one(engine, f"line-{i}", ids, params))
        if next_out not in pending:
            return
        yield tok.decode(await pending.pop(next_out))
        next_out += 1


async def engine_translations(bundle_dir: str, lines: list[str], params: SamplingParams, slots: int,
                              threads: int | None, provider: str) -> AsyncIterator[str]:
    """The translations of `lines` in order, by an Engine of the bundle started here and stopped at the end."""
    from export.bundle import load_bundle
    from serving.engine.engine import Engine

    bundle = load_bundle(bundle_dir)
    if bundle.task != "translate":
        raise ValueError(f"bundle {bundle_dir} is a {bundle.task!r} model; kvserve translate needs a translation "
                         f"bundle")
    tok = bundle.load_tokenizer()
    params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, bundle.config.max_len))
    config = EngineConfig(max_slots=slots, provider=provider, intra_op_threads=threads,
                          max_waiting=max(64, 4 * slots), max_prompt_tokens=bundle.config.max_len,
                          max_new_tokens=bundle.config.max_len)
    engine = await asyncio.to_thread(Engine.from_bundle, bundle_dir, config)
    await engine.start()
    try:
        async for text in translate_lines(engine, tok, lines, params, 2 * slots // params.beam_size + 1):
            yield text
    finally:
        await engine.stop(drain_timeout_s=5.0)


async def run(bundle_dir: str, lines: list[str], out: TextIO, params: SamplingParams, slots: int,
              threads: int | None, provider: str, progress: bool) -> int:
    from tqdm import tqdm

    with tqdm(total=len(lines), file=sys.stderr, unit="sent", disable=not progress) as bar:
        async for text in engine_translations(bundle_dir, lines, params, slots, threads, provider):
            out.write(text + "\n")
            bar.update(1)
    out.flush()
    return 0


def translate_texts(bundle_dir: str, texts: list[str], params: SamplingParams, slots: int = 16,
                    threads: int | None = None, provider: str = "auto", progress: bool = False) -> list[str]:
    """The engine's translations of `texts`, in order (`kvserve evaluate --beam-size` scores a bundle by them,
    `kvserve distill` makes training data of them); `progress` draws a bar on stderr."""
    from tqdm import tqdm

    async def collect() -> list[str]:
        out = []
        with tqdm(total=len(texts), file=sys.stderr, unit="sent", disable=not progress) as bar:
            async for text in engine_translations(bundle_dir, texts, params, slots, threads, provider):
                out.append(text)
                bar.update(1)
        return out

    return asyncio.run(collect())


def evaluate_search(bundle_dir: str, split: str, limit: int | None, data_dir: str, beam_size: int,
                    length_penalty: float) -> dict[str, Any]:
    """chrF and BLEU of a translation bundle's beam search on a split, through the engine as served (greedy
    decoding is export.evaluate's): the report `kvserve evaluate BUNDLE --beam-size N` prints."""
    import time

    from export.bundle import load_bundle
    from export.evaluate import scores
    from model.data import load_pairs
    from model.scores import search_record

    bundle = load_bundle(bundle_dir)
    if bundle.task != "translate":
        raise ValueError(f"beam search is for translation; {bundle_dir} is a {bundle.task!r} bundle (drop "
                         f"--beam-size)")
    pairs = load_pairs(data_dir, split)[: limit or None]
    params = SamplingParams(max_new_tokens=bundle.config.max_len - 1, beam_size=beam_size,
                            length_penalty=length_penalty)
    t0 = time.perf_counter()
    hyps = translate_texts(bundle_dir, [s for s, _ in pairs], params, slots=max(16, beam_size))
    return {"bundle": bundle_dir, "task": bundle.task, "variant": bundle.variant.value, "split": split,
            "backend": "engine", "sentences": len(pairs), **scores(hyps, [t for _, t in pairs]),
            **search_record(beam_size, length_penalty), "seconds": round(time.perf_counter() - t0, 2)}


def _cmd_translate(args: argparse.Namespace) -> int:
    if args.beam_size < 1 or args.max_tokens < 1 or args.slots < args.beam_size:
        raise ValueError(f"--beam-size ({args.beam_size}) and --max-tokens ({args.max_tokens}) must be >= 1 and "
                         f"--slots ({args.slots}) >= --beam-size")
    lines = [line.rstrip("\n").rstrip("\r") for line in sys.stdin]
    params = SamplingParams(max_new_tokens=args.max_tokens, beam_size=args.beam_size,
                            length_penalty=args.length_penalty)
    return asyncio.run(run(args.bundle, lines, sys.stdout, params, args.slots, args.threads, args.provider,
                           not args.no_progress))


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "translate", help="translate stdin to stdout, a sentence per line, with a translation bundle",
        description="Offline batch translation: reads one sentence per line from stdin, writes one translation "
                    "per line to stdout in the same order, through the continuous-batching engine in this process "
                    "(no server). A progress bar goes to stderr. Any translation bundle: kvserve's own or imported "
                    "with `kvserve import marian`.")
    p.add_argument("bundle", help="translation bundle directory")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy (default); > 1 = beam search")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens per translation (default 128; capped by the model's max_len)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam ranking: score / length^penalty")
    p.add_argument("--slots", type=int, default=16, help="KV-cache slots = rows per engine step (default 16)")
    p.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default 1)")
    p.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda"), help="ONNX Runtime provider")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_cmd_translate)
