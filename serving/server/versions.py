"""Model versions: what `model@version` names, and which deployment of a model answers a request.

A model is served by one Serve deployment per bundle: `<model>`, and with a canary also `<model>-canary`
(serving/server/config.py `ModelSpec.deployments`), each with a share of the model's traffic. Every bundle has
a content version (export/bundle.py `content_version`); each replica says the version it serves
(serving/server/replica.py `info`), and every answer names it (the X-Model-Version header). During a rolling
update a deployment serves two versions at once for a while; the version an answer names is always the one
of the replica that produced it.

`Router` picks the deployment for a request: the one serving the version the request names, or else by the
configured weights with smooth weighted round-robin (nginx's), so that a 90/10 split is 90/10 over any 10
consecutive requests of one ingress replica, not just on average.

Does not own: asking the replicas for their versions (serving/server/ingress.py caches that), HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedVersion:
    """One bundle of a model as served now: by which deployment, and with what share of the model's traffic."""

    model: str
    deployment: str
    version: str
    created: int  # when the bundle was written (Unix seconds)
    weight: float  # percent of the model's requests that name no version


def split_model_name(name: str) -> tuple[str, str | None]:
    """'generate@3f2a9c0d1e2b' -> ('generate', '3f2a9c0d1e2b'); 'generate' -> ('generate', None)."""
    model, sep, version = name.partition("@")
    return (model, version) if sep else (model, None)


class Router:
    """The deployment that serves a request for a model, by weight or by the version it names."""

    def __init__(self, routes: dict[str, list[tuple[str, float]]]) -> None:
        """`routes`: model -> [(deployment, percent of its traffic), ...]; the percents of a model add to 100."""
        for model, choices in routes.items():
            if not choices or abs(sum(w for _, w in choices) - 100.0) > 1e-6 or min(w for _, w in choices) < 0:
                raise ValueError(f"model {model!r}: weights {choices} must be >= 0 and add up to 100")
        self.routes = {m: list(c) for m, c in routes.items()}
        self._current = {m: [0.0] * len(c) for m, c in routes.items()}  # smooth weighted round-robin state

    def deployments(self, model: str) -> list[str]:
        return [d for d, _ in self.routes[model]]

    def pick(self, model: str) -> str:
        """The next deployment for a request naming no version (smooth weighted round-robin)."""
        choices, current = self.routes[model], self._current[model]
        if len(choices) == 1:
            return choices[0][0]
        for i, (_, weight) in enumerate(choices):
            current[i] += weight
        best = max(range(len(choices)), key=current.__getitem__)
        current[best] -= 100.0
        return choices[best][0]

    @staticmethod
    def serving(model: str, version: str, served: list[ServedVersion]) -> str | None:
        """The deployment serving `version` of `model` now, if any."""
        return next((s.deployment for s in served if s.model == model and s.version == version), None)
