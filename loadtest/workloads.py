"""What the load tester sends: inputs from the held-out test split and the JSON body of each endpoint.

Translation sentences come from `model.data.load_pairs(data_dir, "test")` and generation prompts are cut
from `model.data.load_text(data_dir, "test")`; when the data directory has not been prepared a small
built-in list of English sentences is used and the report says so. Request i always gets the same input
and sampling seed for a given run seed, whatever the order in which requests are sent. Sending and
parsing answers is loadtest/client.py's business.
"""
from __future__ import annotations

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
        from model import data  # torch-free; imported late so a missing module reads as "no data"
    except ImportError as e:  # pragma: no cover - model/ ships with the package
        return _fallback(f"model.data is not importable ({e})")
    try:
        if workload is Workload.TRANSLATE:
            texts = [en for en, _ in data.load_pairs(data_dir, "test") if en.strip()]
            what = "English side of"
        else:
            texts = [p for p in data.lm_prompts(data.load_text(data_dir, "test"), N_PROMPTS, PROMPT_CHARS)
                     if p.strip()]
            what = f"{PROMPT_CHARS}-character prompts cut from"
    except (OSError, data.DataError) as e:
        return _fallback(f"{data_dir}/{task} is not prepared ({e})")
    if not texts:
        return _fallback(f"{data_dir}/{task} test split is empty")
    return Inputs(tuple(texts), f"{len(texts)} {what} {data_dir}/{task} test split", False)


def _fallback(why: str) -> Inputs:
    return Inputs(FALLBACK_SENTENCES, f"built-in list of {len(FALLBACK_SENTENCES)} English sentences: {why}",
                  True)


def request_body(config: LoadConfig, inputs: Inputs, index: int) -> dict[str, Any]:
    """The JSON body of request `index` (its input and seed depend only on config.seed and index)."""
    rng = np.random.default_rng([config.seed, 0x10AD, index])
    text = inputs.texts[int(rng.integers(len(inputs.texts)))]
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
