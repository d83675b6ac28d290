"""Security: the API key, bundle integrity, and no unpickling of anything untrusted.

- Authentication (serving/server/auth.py): with a key set (from the environment, `api_key_env`, as a Secret
  reaches a pod), every path but the health probes (per-model readiness included) and /metrics -- and
  /metrics too with `metrics_require_key` -- needs `Authorization: Bearer <key>` (401 +
  `WWW-Authenticate: Bearer` otherwise, unknown paths and /docs included); the key is compared in constant time (`hmac.compare_digest` of SHA-256 digests) and never
  appears in a log line or a response. Fast: the real API in-process (tests/inprocess_app.py); slow: the
  reliability application on a real Ray Serve cluster, whose every log file is searched for the key.
- Integrity: a bundle with a changed or missing file, or a manifest that does not match, is refused by the
  serving entry point (`Engine.from_bundle`) with an error naming the file, and on the cluster the
  deployment fails to start with that message (export/bundle.py's own cases are in tests/test_bundle.py).
- No unpickling: no project module calls a deserializer that can run code; checkpoints are safetensors +
  JSON + `torch.load(weights_only=True)`, shown here with a payload that would run code if unpickled; and
  serving a bundle runs with pickle disabled.
"""
from __future__ import annotations

import ast
import hmac
import json
import logging
import pickle
import shutil
import time
from pathlib import Path

import httpx
import pytest

from engine_bundle import cached_bundle
from export.bundle import BundleError
from inprocess_app import InProcessServer
from serving.server.auth import HEALTH_PATHS, OPEN_PATHS, BearerAuth, key_sha256
from serving.server.config import AppArgs, Limits

ROOT = Path(__file__).resolve().parents[1]
KEY = "kvs-secret-" + "Zq8w" * 8
KEY_ENV = "KVSERVE_SECURITY_TEST_KEY"
LIMITS = Limits(max_prompt_tokens=32, max_tokens=8, default_max_tokens=4)


@pytest.fixture(scope="module")
def server():
    s = InProcessServer(LIMITS, api_key=KEY)
    yield s
    s.close()


@pytest.fixture(scope="module", params=[False, True], ids=["metrics-open", "metrics-require-key"])
def env_keyed(request):
    """The app with its key read from the environment (`api_key_env`), /metrics open or behind the key."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, KEY)
        args = AppArgs.model_validate({"models": [{"name": "generate", "bundle": "b"}], "api_key_env": KEY_ENV,
                                       "metrics_require_key": request.param})
        s = InProcessServer(LIMITS, api_key=args.resolved_api_key(), metrics_require_key=args.metrics_require_key)
    yield s
    s.close()


def _routes(server: InProcessServer) -> list[tuple[str, str]]:
    """(method, path) of every route the app has, its documentation pages included ({name}: a served model)."""
    out = []
    for route in server.app.routes:
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            if method != "HEAD":
                out.append((method, route.path.replace("{name}", "generate")))
    return out


# -- authentication ------------------------------------------------------------------------------------------
def test_every_route_but_health_and_metrics_needs_the_key(env_keyed):
    server = env_keyed
    model_ready = {"/v2/models/generate/ready", "/v2/models/translate/ready"}
    open_paths = HEALTH_PATHS | model_ready | (set() if server.metrics_require_key else {"/metrics"})
    routes = _routes(server) + [("GET", "/v2/models/translate/ready")]
    assert {p for _, p in routes} >= {"/v1/generate", "/v1/translate", "/v1/completions", "/v1/models", "/docs",
                                      "/openapi.json", *OPEN_PATHS, *model_ready}
    body = {"prompt": "the", "max_tokens": 2}
    for method, path in routes + [("GET", "/no/such/path"), ("DELETE", "/v1/generate")]:
        for headers in ({}, {"Authorization": f"Bearer {KEY}x"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "}):
            r = server.request(method, path, json=body if method == "POST" else None, headers=headers)
            if path in open_paths:
                assert r.status_code == 200, (method, path, r.text)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["type"] == "unauthorized" and "Bearer" in r.json()["error"]["message"]
    good = {"Authorization": f"Bearer {KEY}"}
    assert server.request("GET", "/v1/models", headers=good).status_code == 200
    metrics = server.request("GET", "/metrics", headers=good)
    assert "kvserve_requests_total" in metrics.text  # either way
    # open: a shared cache (HAProxy, serving/server/launch.py) may keep it for 1 s; behind the key: none may
    assert metrics.headers["cache-control"] == ("private, no-store" if server.metrics_require_key
                                                else "public, max-age=1")
    assert server.request("GET", "/v2/models/nope/ready").status_code == 404  # open, but only for served models
    assert server.request("GET", "/docs", headers=good).status_code == 200
    assert server.request("POST", "/v1/generate", json=body, headers={"Authorization": f"bearer  {KEY} "}
                          ).status_code == 200  # the scheme is case-insensitive (RFC 9110 11.1)
    assert server.request("POST", "/v1/generate", json=body, headers=good).status_code == 200


def test_a_refused_request_body_is_never_read(server):
    """401 comes before the body is read: an anonymous client cannot make the server take in megabytes."""
    reads = []

    async def body():
        for _ in range(64):
            reads.append(1)
            yield b"x" * 65_536
    r = server.request("POST", "/v1/generate", content=body(), headers={"content-type": "application/json"})
    assert r.status_code == 401 and len(reads) <= 1


def test_the_key_is_compared_in_constant_time(server, monkeypatch):
    """Every check, right or wrong, runs hmac.compare_digest on two SHA-256 digests (fixed length: the time
    depends neither on where the strings differ nor on the key's length)."""
    calls = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return real(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    cases = {None: 401, f"Bearer {KEY}": 200, f"Bearer {KEY[:-1]}": 401, f"Bearer {KEY}{KEY}": 401, "Bearer": 401,
             f"Token {KEY}": 401}
    for header, status in cases.items():
        headers = {} if header is None else {"Authorization": header}
        assert server.request("GET", "/v1/models", headers=headers).status_code == status, header
    assert calls == [(32, 32)] * len(cases)


def test_the_key_is_never_logged_or_echoed(server, caplog):
    caplog.set_level(logging.DEBUG)
    responses = [server.request("GET", "/v1/models", headers={"Authorization": f"Bearer {KEY}"}),
                 server.request("GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"}),
                 server.request("POST", "/v1/generate", json={"prompt": "x", "top_p": 7},
                                headers={"Authorization": f"Bearer {KEY}"}),
                 server.request("POST", "/v1/generate", content=b"{bad json",
                                headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})]
    assert [r.status_code for r in responses] == [200, 401, 422, 422]
    for r in responses:
        assert KEY not in r.text and KEY not in str(r.headers)
    assert KEY not in caplog.text
    args = AppArgs.model_validate({"models": [{"name": "generate", "bundle": "b"}], "api_key": KEY})
    assert KEY not in repr(args) and KEY not in args.model_dump_json() and KEY not in str(args)
    middleware = next(m for m in server.app.user_middleware if m.cls is BearerAuth)
    assert KEY not in repr(middleware) and KEY not in repr(BearerAuth(None, key_sha256(KEY)))


def test_an_unset_key_variable_fails_closed_without_naming_a_key(monkeypatch):
    monkeypatch.delenv("KVSERVE_NO_SUCH_KEY", raising=False)
    args = AppArgs.model_validate({"models": [{"name": "generate", "bundle": "b"}], "api_key_env": "KVSERVE_NO_SUCH_KEY"})
    with pytest.raises(ValueError, match="KVSERVE_NO_SUCH_KEY"):
        args.resolved_api_key()


# -- integrity -------------------------------------------------------------------------------------------------
def _tamper(bundle: Path, how: str) -> str:
    """Damage a bundle copy; returns what the refusal must name."""
    if how == "changed":
        data = bytearray((bundle / "decoder.onnx").read_bytes())
        data[len(data) // 2] ^= 0x01
        (bundle / "decoder.onnx").write_bytes(bytes(data))
        return "decoder.onnx was changed"
    if how == "missing":
        (bundle / "tokenizer.json").unlink()
        return "missing file tokenizer.json"
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["model_config"]["max_len"] *= 2  # the graphs no longer match what the manifest describes
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return "manifest.json: its graph contracts differ"


@pytest.mark.parametrize("how", ["changed", "missing", "manifest"])
def test_serving_refuses_a_damaged_bundle_naming_the_file(tmp_path, how):
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine

    bundle = Path(shutil.copytree(cached_bundle("generate")[0], tmp_path / "bundle"))
    needle = _tamper(bundle, how)
    with pytest.raises(BundleError, match=needle):
        Engine.from_bundle(bundle, EngineConfig(max_slots=1, provider="cpu", intra_op_threads=1))


# -- no unpickling ------------------------------------------------------------------------------------------------
UNSAFE_CALLS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cloudpickle", "load"),
                ("cloudpickle", "loads"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"),
                ("marshal", "load"), ("marshal", "loads"), ("shelve", "open"), ("yaml", "unsafe_load"),
                ("yaml", "full_load"), ("pd", "read_pickle"), ("pandas", "read_pickle")}


def _safe_loader_names(tree: ast.AST) -> set[str]:
    """Names assigned from an expression that mentions a yaml SafeLoader (e.g. `loader = ... CSafeLoader ...`)."""
    return {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and "SafeLoader" in ast.unparse(node.value)
            for t in node.targets if isinstance(t, ast.Name)}


def unsafe_deserialization(source: str) -> list[str]:
    """Calls in `source` that can run code from data: pickle-family loads, yaml.load, torch.load without
    weights_only=True, numpy loads with allow_pickle=True, eval/exec."""
    found, tree = [], ast.parse(source)
    safe_loaders = _safe_loader_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, kw = node.func, {k.arg: k.value for k in node.keywords}
        name = (f.value.id, f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        line = f"line {node.lineno}: {ast.unparse(node)[:80]}"
        if name in UNSAFE_CALLS or (isinstance(f, ast.Name) and f.id in ("eval", "exec")):
            found.append(line)
        elif name == ("yaml", "load") and not ("Loader" in kw and (
                "SafeLoader" in ast.unparse(kw["Loader"]) or ast.unparse(kw["Loader"]) in safe_loaders)):
            found.append(line)
        elif name == ("torch", "load") and not (isinstance(kw.get("weights_only"), ast.Constant)
                                                and kw["weights_only"].value is True):
            found.append(line)
        elif name in (("np", "load"), ("numpy", "load")) and isinstance(kw.get("allow_pickle"), ast.Constant) \
                and kw["allow_pickle"].value is True:
            found.append(line)
    return found


def test_the_scanner_finds_unsafe_calls():
    bad = ("import pickle, torch, yaml, numpy as np\npickle.loads(b)\ntorch.load(f)\ntorch.load(f, weights_only=False)\n"
           "yaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\nnp.load(f, allow_pickle=True)\neval(s)\n"
           "torch.load(f, weights_only=True)\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.CSafeLoader)\n"
           "ok = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)\nyaml.load(s, Loader=ok)\n")
    assert len(unsafe_deserialization(bad)) == 7


def test_no_project_module_deserializes_code():
    offenders = {}
    for package in ("model", "export", "serving", "loadtest", "deploy"):
        for path in sorted((ROOT / package).rglob("*.py")):
            found = unsafe_deserialization(path.read_text())
            if found:
                offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


class _Payload:
    """Unpickling this object opens (creates) a file: the stand-in for code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_checkpoints_never_unpickle_untrusted_objects(tmp_path):
    torch = pytest.importorskip("torch")
    from model.checkpoint import load_checkpoint, load_train_state

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"optimizer": _Payload(marker)}, ckpt / "train_state.pt")
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        load_train_state(ckpt)
    assert not marker.exists()
    (ckpt / "model.safetensors").write_bytes(pickle.dumps(_Payload(marker)))  # weights that are a pickle
    from model.config import preset
    (ckpt / "checkpoint.json").write_text(json.dumps({"task": "generate",
                                                      "model_config": preset("tiny", "generate", 300).to_dict()}))
    shutil.copy(cached_bundle("generate")[0] / "tokenizer.json", ckpt / "tokenizer.json")
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        load_checkpoint(ckpt)
    assert not marker.exists()
    torch.load(ckpt / "train_state.pt", weights_only=False)  # proof that the payload is live
    assert marker.exists()


def test_serving_a_bundle_never_unpickles(monkeypatch, tmp_path):
    """Load a bundle, build the engine and generate with every pickle entry point made to fail."""
    import asyncio

    import serving.engine.runtime  # noqa: F401  (imported before pickle is disabled, like onnxruntime itself)
    from serving.engine.config import EngineConfig
    from serving.engine.engine import Engine
    from serving.engine.types import GenerationRequest, SamplingParams

    def refuse(*_a, **_k):
        raise AssertionError("something unpickled while serving a bundle")
    for name in ("load", "loads"):
        monkeypatch.setattr(pickle, name, refuse)

    async def run() -> list:
        engine = Engine.from_bundle(cached_bundle("generate")[0],
                                    EngineConfig(max_slots=1, provider="cpu", intra_op_threads=1))
        await engine.start()
        events = [e async for e in engine.submit(GenerationRequest("r", [1, 5, 6], SamplingParams(max_new_tokens=3)))]
        await engine.stop()
        return events
    assert asyncio.run(run())[-1].finish_reason is not None


# -- slow: the real cluster ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cluster_requires_the_key_and_never_logs_it(rel):
    import ray

    paths = [("POST", "/v1/generate"), ("POST", "/v1/translate"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
             ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/no/such/path")]
    with httpx.Client(base_url=rel.base, timeout=30) as anonymous:
        for method, path in paths:
            for headers in ({}, {"Authorization": "Bearer wrong-key"}):
                r = anonymous.request(method, path, json={"prompt": "x"} if method == "POST" else None,
                                      headers=headers)
                assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.text)
        for path in sorted(OPEN_PATHS) + ["/v2/models/generate/ready"]:
            assert anonymous.get(path).status_code == 200, path
    with rel.client() as client:
        assert client.get("/v1/models").status_code == 200 and client.get("/docs").status_code == 200
        r = client.post("/v1/generate", json={"prompt": "the", "max_tokens": 2})
        assert r.status_code == 200, r.text
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert files, logs
    leaked = [str(p) for p in files if rel.api_key.encode() in p.read_bytes()]
    assert leaked == []


@pytest.mark.slow
def test_cluster_refuses_damaged_bundles_naming_the_file(rel):
    """Each damaged bundle is its own application next to the reliability one: its model deployment fails
    to start with the bundle's error, naming the file; the healthy application keeps serving."""
    from ray import serve
    from serving.server.launch import failure_message, start

    raw, needles = json.loads(json.dumps(rel.raw)), {}
    for how in ("changed", "missing", "manifest"):
        bundle = Path(shutil.copytree(rel.art / "bundles" / "generate", rel.art / "bundles" / f"damaged-{how}",
                                      dirs_exist_ok=True))
        needles[how] = _tamper(bundle, how)
        raw["applications"].append({
            "name": f"damaged-{how}", "route_prefix": f"/damaged-{how}", "import_path": "serving.server.app:build_app",
            "args": {"artifacts_dir": str(rel.art), "models": [{"name": "generate", "bundle": f"bundles/damaged-{how}",
                                                                "engine": {"max_slots": 1, "intra_op_threads": 1}}]},
            "deployments": [{"name": "ingress", "ray_actor_options": {"num_cpus": 0.01}},
                            {"name": "generate", "ray_actor_options": {"num_cpus": 0.01}}]})
    try:
        with pytest.raises(RuntimeError, match="failed to deploy") as refused:  # what `kvserve serve` reports
            start(raw, timeout_s=240)
        assert any(needle in str(refused.value) for needle in needles.values()), str(refused.value)[-800:]
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            apps = serve.status().applications
            if {apps[f"damaged-{how}"].status.value for how in needles} == {"DEPLOY_FAILED"}:
                break
            time.sleep(1)
        apps = serve.status().applications
        for how, needle in needles.items():
            app = apps[f"damaged-{how}"]
            message = failure_message(app)
            assert app.status.value == "DEPLOY_FAILED" and needle in message, (how, message[-600:])
        with rel.client() as client:
            assert client.post("/v1/generate", json={"prompt": "the", "max_tokens": 2}).status_code == 200
    finally:
        start(rel.raw, timeout_s=240)  # back to the reliability application alone
