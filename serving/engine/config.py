"""The engine's configuration: every engine knob declared once, with its bounds and its default.

Three sections, by when a knob may change:
- `ReplicaKnobs`: fixed for an engine's lifetime (they size the KV buffers or the ONNX Runtime sessions); the
  Serve config's `models[].engine`.
- `BatchingKnobs`: the batching policy the scheduler applies; they change live (`Engine.reconfigure`); a
  model deployment's `user_config` in the Serve config.
- `RequestBounds`: what one request may ask of the engine; the server derives them from its HTTP limits.

`EngineConfig` is the three together, flat, as the engine reads it; `EngineConfig.compose` builds it from
the sections. The server's config (serving/server/config.py) uses these classes as they are, so a knob has
one set of bounds wherever it is set, and an unknown key is an error that names it.

Does not own: the server's HTTP limits or Ray's deployment options (serving/server/config.py).
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from serving.engine.types import BatchingMode


class _Knobs(BaseModel):
    # Unknown keys are errors: Ray's Serve schema ignores them, so a typo would otherwise pass silently.
    model_config = ConfigDict(extra="forbid", frozen=True)


K = TypeVar("K", bound=_Knobs)  # one section of the knobs


class ReplicaKnobs(_Knobs):
    """Fixed for an engine's lifetime: they size buffers or sessions (a change means a new replica)."""

    max_slots: int = Field(16, ge=1, le=1024, description="KV-cache slots in the pool = most rows in one step.")
    provider: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda)$",
        description="ONNX Runtime provider: auto (CUDA where a GPU is visible), cpu or cuda.",
    )
    intra_op_threads: int | None = Field(
        None, ge=1, le=256, description="ONNX Runtime intra-op threads per replica; None = ORT default."
    )
    step_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description=(
            "Watchdog: a step still running after this many seconds marks the engine unhealthy (a hung ONNX Runtime "
            "call cannot be interrupted): its requests fail with a retryable error (HTTP 503), new ones are refused, "
            "and the replica's health check fails so Ray replaces it. Far above any real step (ms to ~1 s)."
        ),
    )


class BatchingKnobs(_Knobs):
    """The scheduler's policy; `Engine.reconfigure` applies a new value live."""

    batching: BatchingMode = Field(
        BatchingMode.CONTINUOUS,
        description=(
            "continuous (a request joins at the next step, leaves when done), request (gather up to max_batch_size "
            "requests or wait batch_wait_timeout_s, then run that batch to its end) or none (one at a time)."
        ),
    )
    max_waiting: int = Field(
        64,
        ge=0,
        le=100_000,
        description=("Requests that may wait beyond the free slots; more are refused (HTTP 429, reason queue_full)."),
    )
    max_waiting_tokens: int = Field(
        1 << 22,
        ge=1,
        le=1 << 32,
        description=(
            "Bound on the queued work (source + beams x (prompt + max_new_tokens)); more is refused (HTTP 429, "
            "reason queue_tokens)."
        ),
    )
    max_tokens_per_step: int = Field(
        2048,
        ge=1,
        le=1_000_000,
        description=(
            "Token budget of one step (continuous mode): decode rows first, prefill gets the rest (rows x padded "
            "length + encoder tokens); decode rows always run even beyond it."
        ),
    )
    max_batch_size: int = Field(
        16,
        ge=1,
        le=1024,
        description=("Request-level mode: start a batch once this many requests wait (capped at max_slots)."),
    )
    batch_wait_timeout_s: float = Field(
        0.01,
        ge=0.0,
        le=10.0,
        description=("Request-level mode: ...or once the oldest waiting request has waited this long (seconds)."),
    )


class RequestBounds(_Knobs):
    """What one request may ask for; a request beyond them is refused before it waits."""

    max_prompt_tokens: int = Field(4096, ge=1, le=1 << 20, description="Longest prompt / source in tokens.")
    max_new_tokens: int = Field(4096, ge=1, le=1 << 20, description="Largest max_new_tokens.")
    max_beam_size: int = Field(8, ge=1, le=64, description="Largest beam_size (also bounded by max_slots).")


class EngineConfig(ReplicaKnobs, BatchingKnobs, RequestBounds):
    """Every engine knob, flat: the three sections above together."""

    @classmethod
    def compose(cls, replica: ReplicaKnobs, batching: BatchingKnobs, bounds: RequestBounds) -> EngineConfig:
        return cls(**replica.model_dump(), **batching.model_dump(), **bounds.model_dump())

    def section(self, kind: type[K]) -> K:
        """This config's values of one section (e.g. `BatchingKnobs` for the scheduler)."""
        return kind(**{name: getattr(self, name) for name in kind.model_fields})

    def replica_knobs(self) -> ReplicaKnobs:
        return self.section(ReplicaKnobs)

    def batching_knobs(self) -> BatchingKnobs:
        return self.section(BatchingKnobs)
