"""Unit tests of the HTTP API's answers (translate, generate, OpenAI completions, health, metrics), stop
strings, config and metrics aggregation; and the app the other API tests share (`make_client`).

The model side is serving.server.service.ModelService (real) over tests/fake_engine.FakeEngine (scripted), served
in-process through httpx's ASGI transport. Refusals (4xx/5xx) are in tests/test_api_errors.py; the real
engines in tests/test_api_engine.py and, with Ray, test_server_integration.py.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from fake_engine import FakeEngine, tiny_tokenizer
from serving.server.api import create_app
from serving.engine.config import BatchingKnobs
from serving.server.config import AppArgs, Limits, load_serve_config
from serving.server.drain import Drain
from serving.server.metrics import Recorder, aggregate_exposition
from prometheus_client.parser import text_string_to_metric_families
from serving.server.chunks import coalesce
from serving.server.service import ModelService, StreamPiece, TextRequest, TextResult, is_result
from serving.server.stops import StopMatcher
from serving.server.versions import ServedVersion
from serving.engine.types import FinishReason, RequestStats, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
REPLY = "hello world, goodbye world. STOP here"
VERSIONS = {"translate": "0f1e2d3c4b5a", "generate": "a1b2c3d4e5f6"}  # what make_client's models say they are


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


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make_client(tok, limits: Limits | None = None, api_key: str | None = None, root_path: str = "",
                drain: Drain | None = None, **engine_kw):
    recorder = Recorder("prometheus")
    engines = {"translate": FakeEngine(tok, REPLY, encoder_decoder=True, **engine_kw),
               "generate": FakeEngine(tok, REPLY, **engine_kw)}
    limits = limits or Limits(max_prompt_tokens=40, max_tokens=48, default_max_tokens=32)
    services = {n: ModelService(n, e, tok, limits.max_prompt_tokens, recorder, version=VERSIONS[n])
                for n, e in engines.items()}
    app = create_app(LocalBackend(services, recorder), limits, recorder, api_key, drain)
    transport = httpx.ASGITransport(app=app, root_path=root_path)
    client = httpx.AsyncClient(transport=transport, base_url="http://test" + root_path)
    return client, engines


def sse(text: str) -> list:
    return [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]


def assert_error(r: httpx.Response, status: int, field: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if field is not None:
        assert err["field"] == field, err
    return err


# -- translate ------------------------------------------------------------------------------------------
async def test_translate_one_text(tok):
    client, engines = make_client(tok)
    r = await client.post("/v1/translate", json={"text": "the quick brown fox"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "translate"
    assert body["translations"] == [{"text": REPLY, "finish_reason": "stop", "n_best": None}]
    assert body["usage"]["prompt_tokens"] == len(tok.encode("the quick brown fox"))
    assert body["usage"]["completion_tokens"] == len(tok.encode(REPLY))
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["timings"]["total_s"] > 0 and body["timings"]["queue_s"] == pytest.approx(0.0005)
    assert engines["translate"].submitted[0].prompt_ids == tok.encode("the quick brown fox")  # no bos for enc-dec


async def test_translate_list_with_beam_n_best(tok):
    client, engines = make_client(tok)
    r = await client.post("/v1/translate", json={"text": ["a", "b", "c"], "beam_size": 4, "n_best": 3})
    assert r.status_code == 200, r.text
    ts = r.json()["translations"]
    assert len(ts) == 3 and all(len(t["n_best"]) == 3 for t in ts)
    assert ts[0]["text"] == ts[0]["n_best"][0]["text"] == REPLY
    scores = [h["score"] for h in ts[0]["n_best"]]
    assert scores == sorted(scores, reverse=True)
    assert {r.params.beam_size for r in engines["translate"].submitted} == {4}


async def test_translate_length_penalty_reaches_the_beam_search(tok):
    client, engines = make_client(tok)
    for body in ({"text": "x", "beam_size": 2, "length_penalty": 0.6}, {"text": "x", "beam_size": 2}):
        assert (await client.post("/v1/translate", json=body)).status_code == 200
    assert [r.params.length_penalty for r in engines["translate"].submitted] == [0.6, 1.0]  # 1.0: the default


# -- generate ---------------------------------------------------------------------------------------------
async def test_generate_json_prepends_bos(tok):
    client, engines = make_client(tok)
    r = await client.post("/v1/generate", json={"prompt": "hello", "max_tokens": 5, "seed": 3, "temperature": 0.7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    assert body["text"] == tok.decode(tok.encode(REPLY)[:5])
    req = engines["generate"].submitted[0]
    assert req.prompt_ids == [tok.bos_id] + tok.encode("hello")
    assert req.params.seed == 3 and req.params.temperature == 0.7 and req.params.max_new_tokens == 5


async def test_generate_stop_string_trims_and_cancels(tok):
    client, engines = make_client(tok)
    r = await client.post("/v1/generate", json={"prompt": "hi", "stop": ["goodbye"]})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "hello world, " and r.json()["finish_reason"] == "stop"
    assert engines["generate"].cancelled == [engines["generate"].submitted[0].request_id]


@pytest.mark.parametrize("path,body", [("/v1/generate", {"prompt": "hi"}),
                                       ("/v1/completions", {"model": "generate", "prompt": "hi"})])
async def test_stop_token_ids_reach_the_engine(tok, path, body):
    client, engines = make_client(tok)
    for ids in ([5, 7], None):
        r = await client.post(path, json={**body, "stop_token_ids": ids})
        assert r.status_code == 200, r.text
    assert [r.params.stop_token_ids for r in engines["generate"].submitted] == [(5, 7), ()]


async def test_generate_stream_sse(tok):
    client, _ = make_client(tok)
    r = await client.post("/v1/generate", json={"prompt": "hi", "stream": True, "stop": "STOP"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(e) for e in sse(r.text)]
    tokens, final = events[:-1], events[-1]
    assert all(set(e) == {"token", "index"} for e in tokens)
    streamed = "".join(e["token"] for e in tokens)
    assert streamed == final["text"] == "hello world, goodbye world. "  # nothing of the stop string leaks
    assert final["finish_reason"] == "stop" and final["usage"]["completion_tokens"] >= len(tokens)
    assert set(final["timings"]) == {"queue_s", "ttft_s", "total_s"}


# -- OpenAI compatibility ----------------------------------------------------------------------------------
async def test_openai_client_completions_and_models(tok):
    import openai

    client, _ = make_client(tok)
    oai = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1", http_client=client)
    models = await oai.models.list()
    assert sorted(m.id for m in models.data) == ["generate", f"generate@{VERSIONS['generate']}", "translate",
                                                  f"translate@{VERSIONS['translate']}"]
    c = await oai.completions.create(model="generate", prompt="hi", max_tokens=4, temperature=0)
    assert c.choices[0].text == tok.decode(tok.encode(REPLY)[:4]) and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 4
    stream = await oai.completions.create(model="generate", prompt="hi", max_tokens=40, stream=True,
                                          stop=["world."], stream_options={"include_usage": True})
    chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == "hello world, goodbye "
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(tok.encode("hi"))
    t = await oai.completions.create(model="translate", prompt="the fox", max_tokens=8)
    assert t.choices[0].text == tok.decode(tok.encode(REPLY)[:8])
    with pytest.raises(openai.NotFoundError):
        await oai.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.UnprocessableEntityError):
        await oai.completions.create(model="generate", prompt="hi", n=2)


async def test_completions_stream_ends_with_done(tok):
    client, _ = make_client(tok)
    r = await client.post("/v1/completions", json={"model": "generate", "prompt": "hi", "stream": True,
                                                   "max_tokens": 3})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


# -- health, metrics --------------------------------------------------------------------------------
async def test_health_routes(tok):
    client, _ = make_client(tok)
    assert (await client.get("/v2/health/live")).json() == {"status": "live"}
    assert (await client.get("/v2/health/ready")).status_code == 200
    assert_error(await client.get("/v1/nothing"), 404)


@pytest.mark.parametrize("root_path", ["", "/prefix"])  # Ray Serve's route_prefix arrives as root_path
async def test_metrics_count_requests_by_status(tok, root_path):
    client, _ = make_client(tok, capacity=1, root_path=root_path)
    for _ in range(3):
        await client.post("/v1/generate", json={"prompt": "x", "max_tokens": 2})
    await client.post("/v1/generate", json={"prompt": "x", "max_tokens": 0})
    text = (await client.get("/metrics")).text
    v = VERSIONS["generate"]
    assert f'kvserve_requests_total{{endpoint="/v1/generate",model="generate",status="200",version="{v}"}} 3.0' in text
    assert 'kvserve_requests_total{endpoint="/v1/generate",model="none",status="422",version="none"} 1.0' in text
    assert f'kvserve_generated_tokens_total{{model="generate",version="{v}"}} 6.0' in text
    assert f'kvserve_request_duration_seconds_count{{endpoint="/v1/generate",model="generate",version="{v}"}} 3.0' in text
    _promtool_clean(text)


# -- service-level cancellation --------------------------------------------------------------------------
async def test_closing_a_stream_cancels_the_engine_request(tok):
    engine = FakeEngine(tok, REPLY, delay_s=0.001)
    service = ModelService("generate", engine, tok, 40)
    stream = service.stream(TextRequest("hi", SamplingParams(max_new_tokens=30), deadline_wall=9e18))
    first = await stream.__anext__()
    assert isinstance(first, StreamPiece)
    await stream.aclose()  # what a client disconnect does to the route's generator
    assert engine.cancelled == [engine.submitted[0].request_id]
    assert not engine.active


async def test_stats_of_requests_nobody_collects_are_not_kept(tok):
    # The engine reports a request's stats when it finishes, also after its client left: the service keeps
    # them only while a stream is open to read them (a dropped stream's stats are ~1 KB each, its gaps).
    engine = FakeEngine(tok, REPLY, delay_s=0.001)
    service = ModelService("generate", engine, tok, 40)
    stream = service.stream(TextRequest("hi", SamplingParams(max_new_tokens=30), deadline_wall=9e18))
    await stream.__anext__()
    await stream.aclose()
    (_, on_request), = engine.observers
    late = RequestStats(engine.submitted[0].request_id, 2, 3, 0.01, 0.02, (0.001,) * 30, 0.05,
                        FinishReason.CANCELLED)
    on_request(late)  # what the real engine does once the cancelled request leaves its batch
    done = await service.complete(TextRequest("hi", SamplingParams(max_new_tokens=5), deadline_wall=9e18))
    assert done.queue_s is not None  # a finished request still reads its own
    assert service._stats == {}  # neither the abandoned request's stats nor the finished one's


# -- stop strings -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pieces,stops,released,stopped", [
    (["hel", "lo wo", "rld"], ["lo w"], "hel", True),
    (["a", "b", "c"], [], "abc", False),
    (["ST", "O", "x"], ["STOP"], "STOx", False),
    (["xx S", "TOP yy"], ["STOP", "TO"], "xx ", True),
    (["ü", "ber", "!"], ["ber!"], "ü", True),
])
def test_stop_matcher(pieces, stops, released, stopped):
    m, out, hit = StopMatcher(tuple(stops)), "", False
    for p in pieces:
        text, hit = m.push(p)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (released, stopped)


# -- config --------------------------------------------------------------------------------------------------
def _serve_config() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())


def test_serve_config_file_is_valid(tmp_path):
    raw = load_serve_config(ROOT / "deploy" / "serve_config.yaml", artifacts_dir=tmp_path)
    app = raw["applications"][0]
    args = AppArgs.model_validate(app["args"])
    assert app["import_path"] == "serving.server.app:build_app" and args.artifacts_dir == tmp_path.resolve()
    names = {d["name"] for d in app["deployments"]}
    assert names == {"ingress", *(m.name for m in args.models if not m.colocated)}
    assert all(m.colocated for m in args.models)  # the shipped placement: every engine in the ingress replicas
    ingress = next(d for d in app["deployments"] if d["name"] == "ingress")
    assert ingress["backpressure_config"]["status_code"] == 429
    for m in args.models:
        BatchingKnobs.model_validate(ingress["user_config"]["models"][m.name])


@pytest.mark.parametrize("mutate,match", [
    (lambda c: c["applications"][0]["deployments"][0].update(max_ongoing_requests=4), "max_ongoing_requests"),
    (lambda c: c["applications"][0]["deployments"][0]["user_config"]["models"]["generate"].update(max_batch_sise=4),
     "max_batch_sise"),
    (lambda c: c["applications"][0]["args"]["limits"].update(max_beam_size=9), "max_beam_size"),
    (lambda c: c["applications"][0]["args"]["models"][0].update(name="Bad Name"), "Bad Name"),
    (lambda c: c["applications"][0]["deployments"].append({"name": "ghost"}), "ghost"),
    (lambda c: c["applications"][0]["args"]["models"][1].update(name="translate"), "unique"),
])
def test_serve_config_rejects(tmp_path, mutate, match):
    cfg = _serve_config()
    mutate(cfg)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match=match):
        load_serve_config(path)


# -- metrics aggregation -------------------------------------------------------------------------------------
def _ray_node(worker: str, n: int) -> str:
    labels = (f'Component="core_worker",WorkerId="{worker}",application="kvserve",deployment="ingress",'
              f'replica="{worker}"')
    return (f"# HELP ray_kvserve_requests_total x\n# TYPE ray_kvserve_requests_total counter\n"
            f'ray_kvserve_requests_total{{{labels},endpoint="/v1/generate",model="generate",status="200"}} {n}\n'
            f"# HELP ray_kvserve_engine_batch_size y\n# TYPE ray_kvserve_engine_batch_size histogram\n"
            f'ray_kvserve_engine_batch_size_bucket{{{labels},le="1.0",model="generate"}} 1.0\n'
            f'ray_kvserve_engine_batch_size_bucket{{{labels},le="+Inf",model="generate"}} {n}\n'
            f'ray_kvserve_engine_batch_size_count{{{labels},model="generate"}} {n}\n'
            f'ray_kvserve_engine_batch_size_sum{{{labels},model="generate"}} {2 * n}\n'
            f"# HELP ray_tasks z\n# TYPE ray_tasks gauge\nray_tasks{{{labels}}} 4\n")


def test_aggregation_sums_replicas_and_drops_unbounded_labels():
    text = aggregate_exposition([_ray_node("w1", 7), _ray_node("w2", 3)])
    assert 'kvserve_requests_total{endpoint="/v1/generate",model="generate",status="200"} 10.0' in text
    assert 'kvserve_engine_batch_size_bucket{le="1.0",model="generate"} 2.0' in text
    assert 'kvserve_engine_batch_size_sum{model="generate"} 20.0' in text
    assert "replica=" not in text and "WorkerId" not in text and "ray_tasks" not in text
    assert "# TYPE kvserve_time_to_first_token_seconds histogram" in text  # declared even before samples
    _promtool_clean(text)


def test_aggregation_reads_the_text_format_as_prometheus_does():
    # prometheus_client's own output (no ray_ prefix, _created samples), an escaped label value, a timestamp.
    r = Recorder("prometheus")
    odd = 'a "quoted" \\ model'
    r.inc("kvserve_generated_tokens_total", {"model": odd, "version": "v1"}, 5)
    r.observe("kvserve_engine_batch_size", {"model": odd, "version": "v1"}, 3)
    stamped = 'ray_kvserve_generated_tokens_total{model="m",version="v1",WorkerId="w"} 2.0 1700000000000\n'
    text = aggregate_exposition([r.exposition(), r.exposition(), stamped])
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {s.labels["model"]: s.value for s in families["kvserve_generated_tokens"].samples}
    assert tokens == {odd: 10.0, "m": 2.0}
    buckets = {s.labels["le"]: s.value for s in families["kvserve_engine_batch_size"].samples
               if s.name.endswith("_bucket")}
    assert buckets["2.0"] == 0.0 and buckets["4.0"] == 2.0 and buckets["+Inf"] == 2.0
    assert "_created" not in text


def _promtool_clean(text: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        return  # the integration suite and CI run it where the `prometheus` package is installed
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_promtool_clean_on_every_declared_metric():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    r = Recorder("prometheus")
    labels = {"model": "m", "version": "0123456789ab", "endpoint": "/v1/generate", "status": "200", "reason": "queue_full"}
    from serving.server.metrics import METRICS, Kind
    for d in METRICS.values():
        lab = {k: labels[k] for k in d.labels}
        {Kind.COUNTER: r.inc, Kind.HISTOGRAM: r.observe, Kind.GAUGE: r.set}[d.kind](d.name, lab, 1.0)
    _promtool_clean(aggregate_exposition([r.exposition()]))


# -- kvserve serve (no Ray started) ----------------------------------------------------------------------------
def test_serve_cli_refuses_missing_bundles(tmp_path):
    from kvserve.cli import build_parser
    from serving.server.launch import prepare_config

    args = build_parser().parse_args(["serve", "--artifacts", str(tmp_path), "--port", "9000"])
    assert args.func.__name__ == "_cmd_serve" and args.port == 9000
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "bundles" / "translate")):
        prepare_config(ROOT / "deploy" / "serve_config.yaml", artifacts=tmp_path)


def test_serving_never_imports_torch():
    code = ("import sys, serving.server.app, serving.server.api, serving.server.launch, serving.server.metrics; "
            "assert 'torch' not in sys.modules, 'serving imported torch'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
