"""The runtime that kvserve's commands inject into export's checks: serving's ONNX Runtime `ModelRuntime`.

export/ evaluates and checks a bundle through whatever runtime it is given (export/evaluate.py
`RuntimeFactory`), because serving reads the bundle format from export and export must not import serving
back. The composition roots (`kvserve evaluate`, `kvserve export`, `python -m kvserve.parity`, and tests)
build the real one here. ModelRuntime, and with it onnxruntime, is imported only when a runtime is built.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from export.bundle import Bundle
    from export.evaluate import RuntimeFactory
    from serving.engine.runtime import ModelRuntime


def ort_runtime(provider: str = "auto", threads: int | None = None,
                decoder_graph: str | None = None) -> "RuntimeFactory":
    """A factory of ONNX Runtime runtimes: `make(bundle, n_slots)` -> ModelRuntime on `provider` ("auto",
    "cpu" or "cuda") with `threads` intra-op threads (None: ModelRuntime's default, 1) and the given decoder
    graph (None: the one the provider serves)."""

    def make(bundle: "Bundle", n_slots: int) -> "ModelRuntime":
        from serving.engine.runtime import ModelRuntime

        return ModelRuntime(bundle, n_slots, provider=provider, intra_op_threads=threads,
                            decoder_graph=decoder_graph)

    return make
