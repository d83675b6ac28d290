"""The quality gate of a reduced-precision variant (int8, int8-dynamic, fp16): measured against its fp32 reference
on a fixed set, and refused beyond a bound.

    translate   chrF of greedy translations of published/eval/everyday.en-de.tsv (120 sentences written for
                kvserve, outside every training source): the variant may lose at most 1.0
    generate    bits per character on published/eval/hamlet.txt (7,902 characters of the test split): the
                variant may add at most 0.02

A quality delta is the criterion, not identical outputs: a correct fp16 or int8 variant changes a few greedy
outputs where two tokens are nearly tied (logits within ~0.01) without losing quality, while a broken one loses
points. `kvserve export --variant ...` refuses a variant that fails (the bundle is not written); the GPU check
(bench/gpu_check) applies the same gate to the fp16 bundle on CUDA.

TORCH-FREE: both sides are StepRuntimes (export/evaluate.py), the reference usually PyTorch's fp32 model
(export/parity.py TorchRuntime) or the fp32 bundle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from export.evaluate import StepRuntime, lm_chunks, nll_bits, scores, translate_texts
from model.published import everyday_pairs, lm_text


@dataclass(frozen=True)
class Bound:
    metric: str
    higher_is_better: bool
    max_loss: float  # how much worse than the reference the variant may be

    def passed(self, reference: float, variant: float) -> bool:
        loss = (reference - variant) if self.higher_is_better else (variant - reference)
        return loss <= self.max_loss


BOUNDS = {"translate": Bound("chrf", True, 1.0), "generate": Bound("bits_per_char", False, 0.02)}


class QualityGateError(ValueError):
    """A variant lost more quality than its bound allows; the message gives both figures and the bound."""


def _quality(task: str, rt: StepRuntime, tok: Any) -> float:
    if task == "translate":
        pairs = everyday_pairs()
        return scores(translate_texts(rt, tok, [s for s, _ in pairs]), [t for _, t in pairs])["chrf"]
    text = lm_text()
    return round(nll_bits(rt, lm_chunks(tok, text, rt.max_len)) / len(text), 4)


def measure(task: str, reference: StepRuntime, variant: StepRuntime, tok: Any) -> dict[str, Any]:
    """Both sides' quality on the task's fixed set, the difference and whether it is within the bound."""
    bound = BOUNDS[task]
    ref, var = _quality(task, reference, tok), _quality(task, variant, tok)
    return {
        "set": "everyday.en-de.tsv" if task == "translate" else "hamlet.txt",
        "metric": bound.metric,
        "reference": ref,
        "variant": var,
        "delta": round(var - ref, 4),
        "max_loss": bound.max_loss,
        "reference_backend": reference.provider,
        "variant_backend": variant.provider,
        "passed": bound.passed(ref, var),
    }


def check(result: dict[str, Any], what: str) -> None:
    """Raise QualityGateError when `result` (from `measure`) failed its bound."""
    if not result["passed"]:
        raise QualityGateError(
            f"{what} fails the quality gate: {result['metric']} on {result['set']} is {result['variant']} against "
            f"the fp32 reference's {result['reference']} (delta {result['delta']:+}; at most {result['max_loss']} "
            f"worse is allowed)"
        )
