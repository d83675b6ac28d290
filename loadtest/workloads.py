"""What the load tester sends: inputs from the held-out test split and the JSON body of each endpoint.

Translation sentences are the English side of the prepared test split (`DATA_DIR/translate/test.tsv`,
`source<TAB>target` per line) and generation prompts are cut at line starts from `DATA_DIR/generate/test.txt`,
the files `kvserve data` writes (model/data.py owns that format; the load tester reads the files itself, so
it imports nothing of the model's code); when the data directory has not been prepared a small built-in
list of English sentences is used and the report says so. Request i always gets the same input
and sampling seed for a given run seed, whatever the order in which requests are sent. Sending and
parsing answers is loadtest/client.py's business.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.config import LoadConfig, Workload

PATHS = {
    Workload.TRANSLATE: "/v1/translate",
    Workload.GENERATE: "/v1/generate",
    Workload.COMPLETIONS: "/v1/completions",
}
N_PROMPTS = 512  # generation prompts cut from the test text
PROMPT_CHARS = 120

FALLBACK_SENTENCES = (
    "The weather is nice today.",
    "Where is the train station?",
    "I would like a cup of coffee, please.",
    "My brother lives in a small house near the river.",
    "We are going to the cinema tonight.",
    "Can you help me with my homework?",
    "The children are playing in the garden.",
    "She has been learning German for three years.",
    "Please close the window, it is cold.",
    "How much does this book cost?",
    "The meeting starts at nine o'clock tomorrow morning.",
    "He forgot his umbrella at the office.",
    "I have never seen such a beautiful city.",
    "The doctor said I should rest for a week.",
    "Our neighbours are very friendly.",
    "It is raining again, so we will stay at home.",
)


@dataclass(frozen=True)
class Inputs:
    """The texts requests are built from and where they came from (shown in the report)."""
    texts: tuple[str, ...]
    source: str
    fallback: bool


def load_inputs(workload: Workload, data_dir: Path) -> Inputs:
    """Test-split sentences or prompts; the built-in sentences if `data_dir` has not been prepared."""
    task = "translate" if workload is Workload.TRANSLATE else "generate"
    try:
        if workload is Workload.TRANSLATE:
            texts = [en for en in read_test_sources(data_dir) if en.strip()]
            what = "English side of"
        else:
            texts = [p for p in read_test_prompts(data_dir, N_PROMPTS, PROMPT_CHARS) if p.strip()]
            what = f"{PROMPT_CHARS}-character prompts cut from"
    except OSError as e:
        return _fallback(f"{data_dir}/{task} is not prepared ({e})")
    if not texts:
        return _fallback(f"{data_dir}/{task} test split is empty")
    return Inputs(tuple(texts), f"{len(texts)} {what} {data_dir}/{task} test split", False)


def read_test_sources(data_dir: Path) -> list[str]:
    """The source (English) side of `DATA_DIR/translate/test.tsv`, in file order."""
    with open(_prepared(Path(data_dir) / "translate" / "test.tsv", "translate"), encoding="utf-8") as f:
        return [line.rstrip("\n").split("\t", 1)[0] for line in f if line.strip()]


def read_test_prompts(data_dir: Path, n: int, chars: int) -> list[str]:
    """`n` prompts of at most `chars` characters cut at evenly spaced line starts of the generation test text
    (the prompts model/data.py `lm_prompts` cuts for evaluation; tests/test_loadtest.py checks they agree)."""
    text = _prepared(Path(data_dir) / "generate" / "test.txt", "generate").read_text(encoding="utf-8")
    starts = [m.start() for m in re.finditer(r"(?m)^\S", text)]
    step = max(1, len(starts) // max(n, 1))
    return [text[s: s + chars].rsplit(" ", 1)[0] for s in starts[::step][:n]]


def _prepared(path: Path, task: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `kvserve data --task {task} --out {path.parent.parent}`")
    return path


def _fallback(why: str) -> Inputs:
    return Inputs(FALLBACK_SENTENCES, f"built-in list of {len(FALLBACK_SENTENCES)} English sentences: {why}",
                  True)


def source_index(config: LoadConfig, index: int) -> int:
    """The request whose input (and seed) request `index` sends: itself, or with `repeat_fraction` an earlier one
    (each earlier request alike), followed back to a request that did not repeat."""
    while config.repeat_fraction and index > 0:
        rng = np.random.default_rng([config.seed, 0x5EE, index])
        if rng.random() >= config.repeat_fraction:
            break
        index = int(rng.integers(index))
    return index


def request_body(config: LoadConfig, inputs: Inputs, index: int) -> dict[str, Any]:
    """The JSON body of request `index` (its input and seed depend only on config.seed and index). With
    `repeat_fraction`, a request that does not repeat takes the input at its own index in a shuffled order, so
    inputs repeat only where a request repeats (while the index is below the number of inputs)."""
    source = source_index(config, index)
    rng = np.random.default_rng([config.seed, 0x10AD, source])
    if config.repeat_fraction is None:
        text = inputs.texts[int(rng.integers(len(inputs.texts)))]
    else:
        order = np.random.default_rng([config.seed, 0x0D]).permutation(len(inputs.texts))
        text = inputs.texts[int(order[source % len(inputs.texts)])]
    seed = int(rng.integers(2**31 - 1))
    max_tokens = config.max_tokens
    if config.min_tokens is not None:  # drawn last, so the text and seed of request i do not change
        max_tokens = int(rng.integers(config.min_tokens, config.max_tokens + 1))
    if config.workload is Workload.TRANSLATE:
        body: dict[str, Any] = {"text": text, "max_tokens": max_tokens}
        if config.beam_size is not None:
            body["beam_size"] = config.beam_size
        return body
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": config.temperature, "seed": seed,
            "stream": config.streams}
    if config.workload is Workload.COMPLETIONS:
        body["model"] = config.model
        if config.streams:
            body["stream_options"] = {"include_usage": True}
    return body
