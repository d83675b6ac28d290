"""`LocalBackend`: serving.server.api.Backend over in-process ModelServices, for the API tests (tests/inprocess_app.py
and the tests that build an app over engines of their own): each model one service, always its one version."""
from __future__ import annotations

from collections.abc import AsyncIterator

from serving.server.chunks import coalesce
from serving.server.metrics import Recorder, aggregate_exposition
from serving.server.service import ModelService, StreamPiece, TextRequest, TextResult, is_result
from serving.server.versions import ServedVersion


class LocalBackend:
    """serving.server.api.Backend over in-process ModelServices."""

    def __init__(self, services: dict[str, ModelService], recorder: Recorder) -> None:
        self.services, self.recorder = services, recorder

    def model_tasks(self) -> dict[str, str]:
        return {n: s.task for n, s in self.services.items()}

    async def model_versions(self) -> list[ServedVersion]:
        return [ServedVersion(n, n, s.version, 0, 100.0) for n, s in self.services.items()]

    async def complete(self, model: str, req: TextRequest) -> TextResult:
        return await self.services[model].complete(req)

    def stream(self, model: str, req: TextRequest) -> AsyncIterator[list[StreamPiece | TextResult]]:
        # As the model replica does (serving/server/replica.py), with no wait: a chunk is what is ready.
        return coalesce(self.services[model].stream(req), 0.0, is_final=is_result)

    async def models_ready(self) -> dict[str, bool]:
        """A model can serve while its (single, in-process) engine is alive and accepting."""
        return {n: not s.engine.snapshot().get("dead") and s.engine.snapshot().get("accepting", True)
                for n, s in self.services.items()}

    async def metrics_text(self) -> str:
        return aggregate_exposition([self.recorder.exposition()])

    async def tokenize(self, model: str, text: str, add_special_tokens: bool) -> dict:
        return self.services[model].tokenize(text, add_special_tokens)

    async def detokenize(self, model: str, ids: list[int]) -> str:
        return self.services[model].detokenize(ids)
