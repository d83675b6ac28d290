"""What the HTTP API (serving/server/api.py) needs from the models behind it: the `Backend` protocol.

In production it is serving/server/ingress.py's `RayBackend` over Serve deployment handles; in tests, in-process
`ModelService`s. Owns only the contract; does not own routing, versions or errors (a call raises `ServiceError`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from serving.server.text_types import StreamPiece, TextRequest, TextResult
from serving.server.versions import ServedVersion


class Backend(Protocol):
    def model_tasks(self) -> dict[str, str]: ...  # model name -> "translate" | "generate"
    async def model_versions(self) -> list[ServedVersion]: ...  # every bundle served now, by model
    # `complete` and `stream` pick the deployment by weight, or the one serving `req.version` (404 if none).
    async def complete(self, model: str, req: TextRequest) -> TextResult: ...
    # Pieces in chunks (serving/server/chunks.py), the TextResult last.
    def stream(self, model: str, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult]]: ...
    async def models_ready(self) -> dict[str, bool]: ...  # model name -> at least one replica can serve it
    # The model's tokenizer (ModelService.tokenize / detokenize), on one of its replicas.
    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> dict: ...
    async def detokenize(self, model: str, ids: list[int]) -> str: ...
    async def metrics_text(self) -> str: ...  # may hand out the same str object while it is fresh
