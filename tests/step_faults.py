"""Test-only fault injection into a real ModelRuntime: a step that hangs, or steps that raise.

`StepFaults.install(runtime)` wraps the runtime's `step` (the ONNX Runtime decoder call the engine's step
thread makes, serving/engine/runner.py) in place, so everything else stays the real thing. A hang blocks the
thread the way a stuck ONNX Runtime call would (nothing can interrupt it) until `release()`. Used by
the fast engine tests (tests/test_engine_faults.py) and, inside a Ray replica, by tests/fault_app.py. Imports
nothing of Ray or the server: production code never imports it.
"""
from __future__ import annotations

import threading
from typing import Any


class StepFaults:
    def __init__(self, step: Any) -> None:
        self._step = step
        self._lock = threading.Lock()
        self._hangs, self._failures, self.calls = 0, 0, 0
        self._released = threading.Event()
        self.hanging = threading.Event()  # set while a step is held

    @classmethod
    def install(cls, runtime: Any) -> "StepFaults":
        faults = cls(runtime.step)
        runtime.step = faults.step
        return faults

    def hang_next(self, steps: int = 1) -> None:
        """The next `steps` calls block until `release()`."""
        with self._lock:
            self._hangs += steps

    def fail_next(self, steps: int = 1) -> None:
        """The next `steps` calls raise RuntimeError (a transient ONNX Runtime error)."""
        with self._lock:
            self._failures += steps

    def release(self) -> None:
        self._released.set()

    def step(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            hang, fail = self._hangs > 0, self._failures > 0 and self._hangs == 0
            self._hangs -= hang
            self._failures -= fail
        if hang:
            self.hanging.set()
            self._released.wait()
        if fail:
            raise RuntimeError("injected ONNX Runtime failure")
        return self._step(*args, **kwargs)
