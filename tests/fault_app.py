"""Test-only Serve application: kvserve's own application graph (serving.server.app.bind_app) whose model
replicas can be told to hang their next engine step, for tests/test_reliability_faults.py.

`HangableModel` is the production `ModelDeployment` with tests/step_faults.py wrapped around its runtime's
`step` (a no-op until told) and one extra method, `inject_hang`, which the test calls through a deployment
handle: the replica that answers blocks its next step in the worker thread for good, as a stuck ONNX
Runtime call would. Everything else -- the engine, its watchdog, the health check, Serve's replacement of
the replica -- is the production code. Serve's controller imports this module by its import path
`tests.fault_app:build_app` (Ray puts the driver's working directory, the repository root, on its workers'
path); production code never imports it.
"""
from __future__ import annotations

import os
from typing import Any

from ray import serve

from serving.server.app import bind_app
from serving.server.config import AppArgs
from serving.server.replica import ModelDeployment
from tests.step_faults import StepFaults


class HangableModel(ModelDeployment.func_or_class):  # type: ignore[name-defined,misc]
    async def __init__(self, spec: dict, bundle_dir: str, limits: dict) -> None:
        await super().__init__(spec, bundle_dir, limits)
        self.faults = StepFaults.install(self.engine.runtime)

    async def inject_hang(self) -> int:
        """This replica's next engine step blocks for good; returns the replica's pid."""
        self.faults.hang_next()
        return os.getpid()


HangableModelDeployment = serve.deployment(HangableModel)


def build_app(args: dict[str, Any]) -> Any:
    return bind_app(AppArgs.model_validate(args), model_deployment=HangableModelDeployment)
