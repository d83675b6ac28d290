"""deploy/: the generated RayService, the kustomize overlays and their offline validation.

Every manifest is checked against the real schemas (kubernetes-validate --strict for core kinds, the CRDs
in deploy/crds for RayService and PodMonitor) with unknown fields rejected, and each kind of typo is
shown to fail. serveConfigV2 must equal what deploy/serve_config.yaml generates.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_helpers import DEPLOY, OVERLAYS, REPO, by_kind, load, rendered_lite

from serving.server.config import split

gen = load("gen_rayservice")
val = load("validate")
kl = load("kustomize_lite")
MODELS = ["translate", "generate"]


def _split(cfg: dict) -> dict:
    """`cfg` (the checkout's colocated Serve config) in split form: a deployment per model (`--placement split`)."""
    split(cfg["applications"][0], MODELS)
    return cfg


def _deployment(cfg: dict, name: str) -> dict:
    return next(d for d in cfg["applications"][0]["deployments"] if d["name"] == name)



def _rayservice(overlay: str = "gpu") -> dict:
    return copy.deepcopy(by_kind(rendered_lite(overlay), "RayService")[0])


def _podmonitor() -> dict:
    return copy.deepcopy(by_kind(rendered_lite("gpu"), "PodMonitor")[0])


# --- generation -----------------------------------------------------------------------------------------

def test_generated_files_are_current() -> None:
    for path, text in gen.outputs().items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: run python deploy/gen_rayservice.py"


@pytest.mark.parametrize("overlay,variant", [("gpu", "gpu"), ("cpu", "cpu"), ("gpu-volume", "gpu")])
def test_serve_config_v2_equals_generation_from_serve_config(overlay: str, variant: str) -> None:
    expected = gen.image_serve_config(gen.load_serve_config(DEPLOY / "serve_config.yaml"), gen.Variant(variant))
    text = _rayservice(overlay)["spec"]["serveConfigV2"]
    assert text == gen.dump_serve_config(expected)
    assert yaml.safe_load(text) == expected


def _flatten(node: object, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in _flatten(sub, f"{prefix}/{key}").items()}
    if isinstance(node, list):
        return {k: v for i, sub in enumerate(node) for k, v in _flatten(sub, f"{prefix}/{i}").items()}
    return {prefix: node}


@pytest.mark.parametrize("placement", ["shipped", "split"])
@pytest.mark.parametrize("variant", list(gen.Variant))
def test_image_config_differs_from_checkout_config_only_by_the_declared_overrides(variant, placement) -> None:
    source = gen.load_serve_config()
    if placement == "split":
        source = _split(source)
    out = gen.image_serve_config(source, variant)
    before, after = _flatten(source), _flatten(out)
    changed = {p for p in before.keys() | after.keys() if before.get(p, object()) != after.get(p, object())}
    allowed = ("/http_options/", "/args/artifacts_dir", "/bundle", "/engine/provider", "/num_replicas",
               "/autoscaling_config/", "/ray_actor_options/num_cpus", "/ray_actor_options/num_gpus",
               "/args/api_key", "/args/api_key_env", "/graceful_shutdown_timeout_s", "/bundle_sha256",
               "/args/metrics_require_key")
    assert changed and all(any(a in p for a in allowed) for p in changed), sorted(changed)
    app = out["applications"][0]
    for model in app["args"]["models"]:
        assert f"{app['args']['artifacts_dir']}/{model['bundle']}" == f"/models/{model['name']}"
        assert model["engine"]["provider"] == {"gpu": "cuda", "cpu": "cpu"}[variant.value]
    colocated = [m["name"] for m in app["args"]["models"] if m.get("colocated")]
    # How many engines each deployment's replica holds: the ingress its colocated models', a model deployment one.
    engines = {d["name"]: len(colocated) if d["name"] == "ingress" else 1 for d in app["deployments"]}
    assert engines == ({"ingress": 2} if placement == "shipped" else {"ingress": 0, "translate": 1, "generate": 1})
    for dep in app["deployments"]:
        n = engines[dep["name"]]
        assert "num_replicas" not in dep and dep["autoscaling_config"]["min_replicas"] >= 1
        assert dep["autoscaling_config"] == (gen.MODEL_AUTOSCALING if n else gen.INGRESS_AUTOSCALING)
        gpus = dep["ray_actor_options"].get("num_gpus", 0)
        assert gpus == (min(1.0, gen.GPU_PER_MODEL_REPLICA * n) if variant is gen.Variant.GPU else 0)
        cpus = dep["ray_actor_options"]["num_cpus"]
        assert cpus == (_deployment(source, dep["name"])["ray_actor_options"]["num_cpus"] if n
                        else gen.INGRESS_NUM_CPUS) and cpus > 0
    if variant is gen.Variant.GPU and placement == "shipped":  # both models' engines: one GPU per ingress replica
        assert _deployment(out, "ingress")["ray_actor_options"]["num_gpus"] == 1.0
    assert out["http_options"]["host"] == "0.0.0.0" and out["http_options"]["port"] == 8000
    assert "api_key" not in app["args"] and app["args"]["api_key_env"] == gen.API_KEY_ENV
    assert all(d["graceful_shutdown_timeout_s"] >= app["args"]["limits"]["request_timeout_s"]
               for d in app["deployments"])


@pytest.mark.parametrize("placement,name", [("split", "generate"), ("shipped", "ingress")])
def test_generator_refuses_a_model_deployment_without_cpu(placement: str, name: str) -> None:
    """A deployment that holds engines keeps the CPUs it asks for: a model deployment (split) or the ingress with
    its colocated models (shipped); with none it could land on the head."""
    cfg = gen.load_serve_config()
    if placement == "split":
        cfg = _split(cfg)
    gen.image_serve_config(cfg, gen.Variant.GPU)  # as it is: accepted
    _deployment(cfg, name)["ray_actor_options"]["num_cpus"] = 0
    with pytest.raises(ValueError, match=f"deployment {name!r} asks for no CPU"):
        gen.image_serve_config(cfg, gen.Variant.GPU)


def _artifacts(root: Path) -> Path:
    """An artifacts directory with a manifest in each bundle (all prepare_config checks), as tests/test_launch.py's
    `art`: at bundles/<task> as the checkout's config names them and at <task> as the images' config does."""
    for task in MODELS:
        for bundle in (root / "bundles" / task, root / task):
            bundle.mkdir(parents=True)
            (bundle / "manifest.json").write_text(json.dumps({"task": task}))
    return root


@pytest.mark.parametrize("variant", list(gen.Variant))
def test_image_config_is_what_kvserve_serve_and_the_soak_run_plus_the_declared_overrides(variant, tmp_path) -> None:
    """One source: the images' and the RayService's Serve config is deploy/serve_config.yaml as `kvserve serve`
    deploys it (prepare_config, the file's own placement) through gen_rayservice's overrides, and the soak runs
    that same application; and the image's CMD, naming no placement, keeps the file's (colocated) one."""
    from bench.soak import soak_config
    from serving.server import launch

    art = _artifacts(tmp_path)
    image_file = DEPLOY / "docker" / f"serve_config.{variant.value}.yaml"
    image = yaml.safe_load(image_file.read_text(encoding="utf-8"))
    served = launch.prepare_config(DEPLOY / "serve_config.yaml", artifacts=art)
    assert gen.image_serve_config(served, variant) == image
    assert yaml.safe_load(by_kind(rendered_lite(variant.value), "RayService")[0]["spec"]["serveConfigV2"]) == image
    soaked = soak_config(art, port=18123)
    assert soaked["http_options"]["port"] == 18123 and soaked["logging_config"]["enable_access_log"] is False
    assert {**soaked, "http_options": served["http_options"], "logging_config": served["logging_config"]} == served
    app = image["applications"][0]
    assert [m["name"] for m in app["args"]["models"] if m.get("colocated")] == MODELS
    assert [d["name"] for d in app["deployments"]] == ["ingress"]
    in_image = launch.prepare_config(image_file, artifacts=art)  # the CMD's `kvserve serve --config ...`
    assert in_image["applications"][0]["deployments"] == app["deployments"]
    assert in_image["applications"][0]["args"]["models"] == app["args"]["models"]


def test_check_mode_reports_stale_files_and_writes_nothing(tmp_path) -> None:
    cfg = gen.load_serve_config()
    cfg["applications"][0]["args"]["limits"]["max_tokens"] = 128
    changed = tmp_path / "serve_config.yaml"
    changed.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    before = {p: p.read_text(encoding="utf-8") for p in gen.outputs()}
    done = subprocess.run([sys.executable, str(DEPLOY / "gen_rayservice.py"), "--check", "--serve-config",
                           str(changed)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "stale: deploy/k8s/base/rayservice.yaml" in done.stderr
    assert {p: p.read_text(encoding="utf-8") for p in before} == before


# --- rendering ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lite_renderer_matches_real_kustomize(overlay: str) -> None:
    command = kl.kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; kustomize_lite alone renders the overlays")
    real = kl.render_kustomize(DEPLOY / "k8s" / "overlays" / overlay, command)
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(real, key=key) == sorted(rendered_lite(overlay), key=key)


def test_lite_renderer_refuses_what_it_does_not_implement(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(kl.Unsupported, match="commonLabels"):
        kl.render_lite(tmp_path)


def test_gpu_overlay_requests_gpus_and_tolerates_the_taint() -> None:
    spec = _rayservice("gpu")["spec"]["rayClusterConfig"]
    worker = spec["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert toleration in worker["template"]["spec"]["tolerations"]
    assert container["image"] == "kvserve-gpu:0.1.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "serve"}
    assert spec["enableInTreeAutoscaling"] is True and worker["minReplicas"] < worker["maxReplicas"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_cpu_overlay_has_no_gpu_anywhere() -> None:
    docs = rendered_lite("cpu")
    text = yaml.safe_dump_all(docs)
    assert "nvidia.com/gpu" not in text and "num_gpus" not in text and "provider: cuda" not in text
    worker = _rayservice("cpu")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert worker["groupName"] == "cpu-workers" and "tolerations" not in worker["template"]["spec"]
    assert worker["template"]["spec"]["containers"][0]["image"] == "kvserve-cpu:0.1.0"


def test_volume_overlay_mounts_the_models_claim_read_only_everywhere() -> None:
    docs = rendered_lite("gpu-volume")
    claim = by_kind(docs, "PersistentVolumeClaim")[0]
    cluster = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        assert {"name": "models", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"], "readOnly": True}
                } in spec["volumes"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]
        # appended to the template's writable places under the read-only root filesystem, not replacing them
        assert {"name": "tmp", "emptyDir": {}} in spec["volumes"]
        assert {"name": "tmp", "mountPath": "/tmp"} in spec["containers"][0]["volumeMounts"]
    assert "models-volume" in spec["containers"][0]["image"]


def test_monitors_and_pdb_select_the_ray_pods() -> None:
    docs = rendered_lite("gpu")
    cluster = by_kind(docs, "RayService")[0]["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"],
            "worker": cluster["workerGroupSpecs"][0]["template"]}
    for monitor in by_kind(docs, "PodMonitor"):
        wanted = dict(monitor["spec"]["selector"]["matchLabels"])
        node_type = wanted.pop("ray.io/node-type")  # KubeRay sets it on every Ray pod
        assert wanted.items() <= pods[node_type]["metadata"]["labels"].items()
        port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        assert {"name": port, "containerPort": 8080} in pods[node_type]["spec"]["containers"][0]["ports"]
    pdb = by_kind(docs, "PodDisruptionBudget")[0]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods["worker"]["metadata"]["labels"].items()
    assert not pdb["spec"]["selector"]["matchLabels"].items() <= pods["head"]["metadata"]["labels"].items()


# --- validation -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_manifest_validates(overlay: str) -> None:
    docs = rendered_lite(overlay)
    assert {d["kind"] for d in docs} >= {"RayService", "PodMonitor", "PodDisruptionBudget", "Namespace",
                                         "NetworkPolicy"}
    assert val.validate_docs(list(docs)) == []


def test_core_kinds_pass_the_kubernetes_validate_cli_in_strict_mode(tmp_path) -> None:
    core = [copy.deepcopy(d) for d in rendered_lite("gpu-volume") if (d["apiVersion"], d["kind"]) not in val.CRD_FILES]
    good = tmp_path / "core.yaml"
    good.write_text(yaml.safe_dump_all(core), encoding="utf-8")
    cli = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", val.KUBERNETES_VERSIONS[0]]
    assert subprocess.run([*cli, str(good)], capture_output=True, timeout=120).returncode == 0
    core[1]["spec"]["maxUnavailabe"] = core[1]["spec"].pop("maxUnavailable", 1)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(core), encoding="utf-8")
    done = subprocess.run([*cli, str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "maxUnavailabe" in done.stdout + done.stderr


# Each typo sits at a different depth of a schema; the API server would drop every one of them silently.
def _worker(d: dict) -> dict:
    return d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


RAYSERVICE_TYPOS = [
    ("spec", "serveConfigV3", lambda d: d["spec"]),
    ("rayClusterConfig", "enableInTreeAutoScaling", lambda d: d["spec"]["rayClusterConfig"]),
    ("workerGroupSpecs/0", "minReplica", _worker),
    ("pod spec", "toleration", lambda d: _worker(d)["template"]["spec"]),
    ("container", "resource",
     lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]),
    ("probe", "httpGett", lambda d: _worker(d)["template"]["spec"]["containers"][0]["readinessProbe"]),
    ("metadata", "lables", lambda d: d["metadata"]),
]


@pytest.mark.parametrize("where,typo,parent", RAYSERVICE_TYPOS, ids=[t[0] for t in RAYSERVICE_TYPOS])
def test_a_misspelled_rayservice_field_fails(where: str, typo: str, parent) -> None:
    doc = _rayservice()
    parent(doc)[typo] = {} if typo != "serveConfigV3" else "x"
    errors = val.validate_docs([doc])
    assert any(typo in e for e in errors), errors


def test_a_misspelled_podmonitor_field_fails() -> None:
    doc = _podmonitor()
    endpoint = doc["spec"]["podMetricsEndpoints"][0]
    endpoint["prot"] = endpoint.pop("port")
    errors = val.validate_docs([doc])
    assert any("prot" in e for e in errors), errors


def test_the_crd_schema_alone_would_accept_a_typo() -> None:
    """Why the injection matters: the CRD's own schema lets unknown fields through (the API server prunes)."""
    import jsonschema

    crd = val.load_crd(val.crd_dir() / "ray.io_rayservices.yaml")
    loose = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    doc = _rayservice()
    doc["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True
    jsonschema.Draft202012Validator(loose).validate(doc)  # passes: no error raised
    assert val.validate_custom(doc)


def _set_serve(doc: dict, mutate) -> dict:
    cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
    mutate(cfg)
    doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)
    return doc


SERVE_TYPOS = [
    ("num_replicass", lambda c: _deployment(c, "ingress").update(num_replicass=2)),
    ("http_option", lambda c: c.update(http_option={"port": 8000})),
    ("target_ongoing_request", lambda c: _deployment(c, "ingress")["autoscaling_config"]
     .update(target_ongoing_request=3)),
    ("num_gpu", lambda c: _deployment(c, "ingress")["ray_actor_options"].update(num_gpu=1)),
    ("max_slot", lambda c: c["applications"][0]["args"]["models"][0]["engine"].update(max_slot=4)),
    # a colocated model's batching knobs, in the ingress's user_config
    ("max_waitng", lambda c: _deployment(c, "ingress")["user_config"]["models"]["generate"].update(max_waitng=4)),
]


@pytest.mark.parametrize("typo,mutate", SERVE_TYPOS, ids=[t[0] for t in SERVE_TYPOS])
def test_a_misspelled_serve_config_key_fails(typo: str, mutate) -> None:
    doc = _set_serve(_rayservice(), mutate)
    errors = val.validate_serve_config(doc["spec"]["serveConfigV2"])
    assert any(typo in e for e in errors), errors


def test_ray_schema_alone_ignores_unknown_serve_keys() -> None:
    from ray.serve.schema import ServeDeploySchema

    cfg = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    assert [d["name"] for d in cfg["applications"][0]["deployments"]] == ["ingress"]
    cfg["applications"][0]["deployments"][0]["num_replicass"] = 2
    ServeDeploySchema.model_validate(cfg)  # no error: the reason for unknown_keys
    assert val.unknown_keys(ServeDeploySchema, cfg) == ["applications[0].deployments[0].num_replicass"]


BROKEN_CLUSTERS = [
    ("upgradeStrategy", lambda s: s["upgradeStrategy"].update(type="Newcluster")),
    ("num-cpus", lambda s: s["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].pop("num-cpus")),
    ("num-gpus", lambda s: s["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": "1"})),
    ("taint", lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"].pop("tolerations")),
    ("rayVersion", lambda s: s["rayClusterConfig"].update(rayVersion="2.59.0")),
    ("enableInTreeAutoscaling", lambda s: s["rayClusterConfig"].update(enableInTreeAutoscaling=False)),
    ("limits.memory", lambda s: s["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
     ["resources"]["limits"].pop("memory")),
    ("need 6 gpus", lambda s: s["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas=3, replicas=1)),
]


@pytest.mark.parametrize("needle,mutate", BROKEN_CLUSTERS, ids=[b[0] for b in BROKEN_CLUSTERS])
def test_kuberay_facts_outside_the_schema_are_checked(needle: str, mutate) -> None:
    doc = _rayservice()
    if needle == "need 6 gpus":  # the ingress holds both engines, one GPU a replica: 6 replicas, 6 GPUs
        _set_serve(doc, lambda c: [d["autoscaling_config"].update(max_replicas=6)
                                   for d in c["applications"][0]["deployments"]
                                   if d["ray_actor_options"].get("num_gpus")])
    mutate(doc["spec"])
    errors = val.check_rayservice(doc)
    assert any(needle in e for e in errors), errors


def test_a_replica_without_cpu_could_land_on_the_head() -> None:
    """The CPU variant: the ingress asks for CPUs only (on the GPU variant its GPU keeps it off the head)."""
    assert not any("could run on the head" in e for e in val.check_rayservice(_rayservice("cpu")))
    doc = _set_serve(_rayservice("cpu"), lambda c: _deployment(c, "ingress")["ray_actor_options"]
                     .update(num_cpus=0))
    assert any("deployment 'ingress' asks for no CPU or GPU: it could run on the head" in e
               for e in val.check_rayservice(doc))


def test_validate_cli_passes_on_the_repository() -> None:
    done = subprocess.run([sys.executable, str(DEPLOY / "validate.py")], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(": ok") == len(OVERLAYS) + len(val.SERVE_CONFIGS)
