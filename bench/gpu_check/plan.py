"""The gpu check's plan (sizes per device) and the step record every step returns.

`PLANS["cuda"]` fits the whole check in under 8 minutes on a 16-core GPU machine; `PLANS["cpu"]` runs the
same steps on the CPU EP in a few minutes on 2 shared cores (smaller concurrency, fewer tokens, fp16 only
where it is cheap). `Step` is one step's outcome: its status, the reason when it did not pass, its figures
and the named checks it decided (check name -> passed).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Callable


class Status(str, Enum):
    OK = "ok"  # ran; every check it decided passed
    FAILED = "failed"  # ran; a check failed
    SKIPPED = "skipped"  # a prerequisite is missing (the reason says which)
    ERROR = "error"  # raised: the reason holds the exception


@dataclass
class Step:
    name: str
    status: Status = Status.OK
    reason: str | None = None
    seconds: float = 0.0
    checks: dict[str, bool] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, passed: bool) -> bool:
        self.checks[name] = bool(passed)
        if not passed and self.status is Status.OK:
            self.status = Status.FAILED
        return bool(passed)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}


def skipped(name: str, reason: str) -> Step:
    return Step(name, Status.SKIPPED, reason)


def run_step(name: str, fn: Callable[[Step], None], log: Callable[[str], None]) -> Step:
    """Run `fn(step)`; an exception becomes an ERROR step with its message and the traceback's tail."""
    step, t0 = Step(name), time.perf_counter()
    log(f"[gpu-check] {name} ...")
    try:
        fn(step)
    except Exception as e:  # noqa: BLE001 -- a failing step must not stop the others
        step.status = Status.ERROR
        step.reason = f"{type(e).__name__}: {e}"
        step.data["traceback"] = traceback.format_exc(limit=6).splitlines()[-12:]
    step.seconds = round(time.perf_counter() - t0, 1)
    log(f"[gpu-check] {name}: {step.status.value} in {step.seconds} s" + (f" ({step.reason})" if step.reason else ""))
    return step


@dataclass(frozen=True)
class Plan:
    tasks: tuple[str, ...] = ("generate", "translate")
    variants: tuple[str, ...] = ("fp32", "fp16")
    parity_steps: int = 20
    parity_slots: int = 8
    kv_variants: tuple[str, ...] = ("fp32", "fp16")
    engine_variants: tuple[str, ...] = ("fp16", "fp32")  # throughput of the generate model, per variant
    engine_concurrency: tuple[int, ...] = (1, 32, 128)
    engine_requests_per_client: int = 2
    engine_min_new: int = 16
    engine_max_new: int = 64
    invariance_requests: int = 32
    invariance_max_new: int = 24
    server_variant: str = "fp16"
    server_clients: tuple[int, ...] = (32, 128)
    server_duration_s: float = 15.0
    server_warmup_s: float = 2.0
    server_max_tokens: int = 64
    tiny_train_steps: int = 80  # when no checkpoint exists: the tiny preset fitted this many steps
    torch_threads: int = 8


PLANS = {
    "cuda": Plan(),
    "cpu": Plan(kv_variants=("fp32",), engine_variants=("fp32",), engine_concurrency=(1, 8, 32),
                engine_requests_per_client=1, engine_min_new=4, engine_max_new=12, invariance_max_new=12,
                server_variant="fp32", server_clients=(8, 32), server_duration_s=4.0, server_warmup_s=1.0,
                server_max_tokens=16, torch_threads=1),
}
