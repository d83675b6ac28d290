"""README.md's generated blocks, rewritten from their one source each:

    <!-- bench:begin --> ... <!-- bench:end -->     the performance figures: the same block of docs/benchmarks.md
                                                    (bench/glance.py's lines, written there by `kvserve bench`)
    <!-- models:begin --> ... <!-- models:end -->   the published models' table: published/<task>/manifest.json
                                                    (architecture, data, recipe, quality, size on disk)

    python -m bench.readme            # rewrite README.md's blocks from docs/benchmarks.md and published/
    python -m bench.readme --check    # exit 1, naming each block that differs, when README.md is stale

`kvserve bench` rewrites them after writing its report; tests/test_bench_readme.py runs the check in `make test`,
so a README figure that is not the latest report's (or manifest's) fails. Owns the models table's wording and the
markers; measures nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from model.published import BEAM_SET

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = ("bench", "models")
MODELS_HEAD = ["| model | architecture | data | recipe | quality (test split; everyday set) | size |",
               "| --- | --- | --- | --- | --- | --- |"]
PRECISION = {"bf16-autocast": "bf16", "bf16": "bf16, fp32 master weights", "fp32": "fp32"}
TASK_ORDER = ("translate", "generate")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def block(text: str, name: str) -> str | None:
    """The lines between the block's markers (each alone on its line), or None when the text has no such block."""
    begin, end = markers(name)
    lines = text.split("\n")
    if begin not in lines or end not in lines[lines.index(begin):]:
        return None
    start = lines.index(begin)
    return "\n".join(lines[start + 1: lines.index(end, start)])


def splice(text: str, name: str, body: str) -> str:
    """`text` with the block's lines replaced by `body`."""
    begin, end = markers(name)
    if block(text, name) is None:
        raise ValueError(f"no {begin} ... {end} block (each marker alone on its line) to rewrite")
    lines = text.split("\n")
    start = lines.index(begin)
    return "\n".join(lines[: start + 1] + body.split("\n") + lines[lines.index(end, start):])


# -- the published models' table ----------------------------------------------------------------------------------
def _architecture(m: dict[str, Any]) -> str:
    c, vocab = m["model_config"], m["tokenizer"]["vocab_size"]
    layers = (f"encoder-decoder, {c['n_encoder_layers']} encoder + {c['n_decoder_layers']} decoder layers"
              if c["arch"] == "encoder_decoder" else f"decoder-only, {c['n_decoder_layers']} layers")
    bpe = f"{vocab // 1000}k" if vocab % 1000 == 0 else f"{vocab:,}"
    return f"{layers}, d_model {c['d_model']}, {bpe} BPE, {m['weights']['parameters'] / 1e6:.2f}M parameters"


def _data(m: dict[str, Any]) -> str:
    d = m["data"]
    if m["task"] == "translate":
        teacher = d.get("distillation", {}).get("data")  # a distilled model: the pairs its teacher trained on
        pairs = f"{(teacher or {}).get('train_pairs', d['counts']['train']):,} English->German pairs"
        distilled = f"; distilled on their {d['distillation']['pairs_kept']:,} English sides" if teacher else ""
        return f"{pairs} (Ding dictionary examples, game texts from Debian){distilled}"
    if "works" in d:
        return f"Shakespeare's works, {len(d['works']['test'])} held-out plays"
    return str(d.get("source", "?"))


def _quality(m: dict[str, Any]) -> str:
    q = m["metrics"]
    if m["task"] == "translate":
        beam = q.get(BEAM_SET)
        beam_text = f" (beam {beam['beam_size']}: chrF {beam['chrf']:.2f})" if beam else ""
        return (f"test chrF {q['test']['chrf']:.2f}, BLEU {q['test']['bleu']:.2f}{beam_text}; everyday chrF "
                f"{q['everyday']['chrf']:.2f}")
    return f"{q['test']['bits_per_char']:.4f} bits/char; Hamlet excerpt {q['hamlet_excerpt']['bits_per_char']:.4f}"


def models_table(published: Path) -> str:
    """The table of every published model (published/<name>/manifest.json), translate first."""
    manifests = [json.loads(f.read_text()) for f in sorted(published.glob("*/manifest.json"))]
    manifests.sort(key=lambda m: (TASK_ORDER.index(m["task"]) if m["task"] in TASK_ORDER else len(TASK_ORDER),
                                  m["name"]))
    rows = []
    for m in manifests:
        size = sum(f.stat().st_size for f in (published / m["name"]).iterdir() if f.is_file())
        steps = f"{m['training']['steps']:,} steps"
        if m["training"].get("init"):  # fine-tuned: the run it started from first
            steps = f"{m['training']['init']['step']:,} + {steps} (fine-tuned)"
        recipe = f"{steps}, {PRECISION.get(m['recipe']['precision'], m['recipe']['precision'])}"
        rows.append(f"| `{m['name']}` | {_architecture(m)} | {_data(m)} | {recipe} | {_quality(m)} | "
                    f"{size / 1e6:.1f} MB |")
    return "\n".join(MODELS_HEAD + rows)


# -- README.md -----------------------------------------------------------------------------------------------------
def expected(benchmarks: Path, published: Path) -> dict[str, str]:
    """Each block as its source gives it."""
    figures = block(benchmarks.read_text(encoding="utf-8"), "bench")
    if figures is None:
        raise ValueError(f"{benchmarks} has no {markers('bench')[0]} block: write it again with `kvserve bench`")
    return {"bench": figures, "models": models_table(published)}


def stale(readme_text: str, want: dict[str, str]) -> list[str]:
    """The names of the blocks whose lines in README.md are not what their sources give."""
    return [name for name, body in want.items() if block(readme_text, name) != body]


def update(readme: Path, benchmarks: Path, published: Path) -> list[str]:
    """Rewrite README.md's blocks from their sources; the names of those that changed."""
    text = readme.read_text(encoding="utf-8")
    want = expected(benchmarks, published)
    changed = stale(text, want)
    for name in changed:
        text = splice(text, name, want[name])
    if changed:
        readme.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.readme", description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--benchmarks", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--published", type=Path, default=ROOT / "published")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    args = p.parse_args(argv)
    if args.check:
        names = stale(args.readme.read_text(encoding="utf-8"), expected(args.benchmarks, args.published))
        for name in names:
            print(f"{args.readme}: the {name} block differs from its source; run `python -m bench.readme`",
                  file=sys.stderr)
        return 1 if names else 0
    changed = update(args.readme, args.benchmarks, args.published)
    print(f"{args.readme}: rewrote {', '.join(changed) if changed else 'nothing (up to date)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
