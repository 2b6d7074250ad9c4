"""deploy/: each overlay renders (deploy/render.py, the subset of kustomize the overlays use),
validates against the Kubernetes schemas (core kinds, strictly) and KubeRay's CRD (RayCluster),
and its parts fit together: Services select their pods, the router and the head reach Redis and
the Ray head under the names the Services and KubeRay give them, the start scripts pass flags
the CLI has, the worker groups advertise the resources the pools' placement groups ask for, and
a worker's bundle fits one worker pod."""

from __future__ import annotations

import copy
import functools
import gzip
import importlib.util
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import typer
import yaml

from router.policies import POLICIES
from tandem.cli import app
from tandem.cluster.autoscaler import AutoscalerConfig
from tandem.cluster.pools import ClusterSpec, PoolSpec, WorkerActor
from tandem.config import DTYPES, SpecConfig
from tandem.registry import SentinelURL

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRDS = ROOT / "tests" / "data" / "kuberay-crds"
K8S_VERSION = "1.32"
OVERLAYS = {  # what each overlay must set
    "cpu-dev": {"dtype": "float32", "gpus": 0, "image": "tandem:0.1.0-cpu", "workers": (1, 1)},
    "gpu": {"dtype": "bfloat16", "gpus": 1, "image": "tandem:0.1.0-cuda", "workers": (1, 1)},
}
ROLES = ("prefill", "decode")
WORKLOADS = ("Deployment", "StatefulSet")
# Kubernetes' resource quantity, as the KubeRay CRD spells it.
QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
    r"(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


def _load_renderer() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_render", DEPLOY / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _load_renderer()


@dataclass
class Rendered:
    name: str
    docs: list[dict[str, Any]]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        [doc] = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        return doc

    @property
    def config(self) -> dict[str, str]:
        return self.one("ConfigMap", "tandem-config")["data"]

    @property
    def ray(self) -> dict[str, Any]:
        return self.one("RayCluster", "tandem")

    @property
    def groups(self) -> dict[str, dict[str, Any]]:
        return {g["groupName"]: g for g in self.ray["spec"]["workerGroupSpecs"]}

    def pod_templates(self) -> dict[str, dict[str, Any]]:
        """Every pod template by owner: Deployments, StatefulSets and the RayCluster's groups."""
        out = {
            d["metadata"]["name"]: d["spec"]["template"]
            for d in self.docs
            if d["kind"] in WORKLOADS
        }
        out["ray-head"] = self.ray["spec"]["headGroupSpec"]["template"]
        for name, group in self.groups.items():
            out[f"ray-{name}"] = group["template"]
        return out


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> Rendered:
    return Rendered(request.param, render.render(DEPLOY / "overlays" / request.param))


def container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]


def script(template: dict[str, Any]) -> str:
    c = container(template)
    assert c["command"] == ["/bin/bash", "-c", "--"], c["command"]
    [text] = c["args"]
    return text


def head_template(rendered: Rendered) -> dict[str, Any]:
    return rendered.ray["spec"]["headGroupSpec"]["template"]


def router_template(rendered: Rendered) -> dict[str, Any]:
    return rendered.pod_templates()["tandem-router"]


def ports(template: dict[str, Any]) -> dict[str, int]:
    """The named ports of every container of the pod."""
    return {
        p["name"]: p["containerPort"]
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
    }


def tandem_argv(text: str, env: dict[str, str]) -> list[str]:
    """The argv a start script passes to `tandem`: its argument-building lines (from `args=(` to
    the `tandem "${args[@]}"` line) run in bash with the pod's environment."""
    code = text[text.index("args=(") : text.index('tandem "${args[@]}"')]
    out = subprocess.run(
        ["bash", "-c", code + 'printf "%s\\0" "${args[@]}"'],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return out.stdout.split("\0")[:-1]


def cli_params(argv: list[str]) -> dict[str, Any]:
    """Parse argv with the real `tandem` CLI (unknown flags and bad values raise)."""
    command = typer.main.get_command(app).commands[argv[0]]  # type: ignore[attr-defined]
    return command.make_context(argv[0], argv[1:]).params


def autoscaler_node_types(ray_cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each group as Ray's KubeRay autoscaler reads it from the RayCluster (its own code): the
    Ray resources a pod of the group offers, and min/max workers."""
    try:
        from ray.autoscaler._private.kuberay.autoscaling_config import (
            _derive_autoscaling_config_from_ray_cr,
        )
    except ImportError as e:  # a private module; Ray may move it
        pytest.skip(f"Ray's KubeRay autoscaling config reader is not importable: {e}")
    metadata = {**ray_cluster["metadata"], "namespace": "default"}
    config = _derive_autoscaling_config_from_ray_cr({**ray_cluster, "metadata": metadata})
    return config["available_node_types"]


# -- rendering and schemas --------------------------------------------------------------------


def test_renders_the_expected_resources(rendered: Rendered) -> None:
    ids = sorted((d["kind"], d["metadata"]["name"]) for d in rendered.docs)
    assert ids == [
        ("ConfigMap", "tandem-config"),
        ("Deployment", "tandem-router"),
        ("PodDisruptionBudget", "tandem-redis"),
        ("PodDisruptionBudget", "tandem-router"),
        ("RayCluster", "tandem"),
        ("Service", "tandem-redis"),
        ("Service", "tandem-router"),
        ("StatefulSet", "tandem-redis"),
    ]
    # The overlays patch workerGroupSpecs by index: 0 must stay prefill, 1 decode.
    assert [g["groupName"] for g in rendered.ray["spec"]["workerGroupSpecs"]] == list(ROLES)


def test_core_kinds_validate_strictly(rendered: Rendered) -> None:
    for doc in rendered.docs:
        if doc["apiVersion"].startswith("ray.io/"):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # The RayCluster's pod templates, as the core PodTemplate they become.
    for owner, template in rendered.pod_templates().items():
        if owner.startswith("ray-"):
            pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": owner}}
            kubernetes_validate.validate({**pod, "template": template}, K8S_VERSION, strict=True)


def test_resource_quantities_parse(rendered: Rendered) -> None:
    for owner, template in rendered.pod_templates().items():
        for c in template["spec"]["containers"]:
            for kind in ("requests", "limits"):
                for resource, value in c.get("resources", {}).get(kind, {}).items():
                    assert QUANTITY.match(str(value)), f"{owner}: {resource}={value!r}"


def strict(schema: Any) -> Any:
    """Reject unknown fields, as `kubectl apply --validate=strict` does; a structural CRD schema
    otherwise lets them through and the API server drops them silently."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(plural: str, version: str) -> jsonschema.protocols.Validator:
    with gzip.open(CRDS / f"ray.io_{plural}.yaml.gz") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def crd_errors(doc: dict[str, Any]) -> list[str]:
    plural = {"RayCluster": "rayclusters", "RayService": "rayservices"}[doc["kind"]]
    group, version = doc["apiVersion"].split("/")
    assert group == "ray.io"
    validator = crd_validator(plural, version)
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_ray_resources_validate_against_kuberay_crds(rendered: Rendered) -> None:
    ray_docs = [d for d in rendered.docs if d["apiVersion"].startswith("ray.io/")]
    assert [d["kind"] for d in ray_docs] == ["RayCluster"]
    for doc in ray_docs:
        assert crd_errors(doc) == []


def test_validators_reject_what_they_should() -> None:
    """The checks are not vacuous: a misspelt field fails both schemas, a non-string
    rayStartParams value fails the CRD, a misspelt flag fails the CLI parse."""
    rendered = Rendered("cpu-dev", render.render(DEPLOY / "overlays" / "cpu-dev"))
    router = copy.deepcopy(rendered.one("Deployment", "tandem-router"))
    container(router["spec"]["template"])["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, K8S_VERSION, strict=True)
    ray = copy.deepcopy(rendered.ray)
    ray["spec"]["workerGroupSpecs"][0]["minReplica"] = 1
    ray["spec"]["workerGroupSpecs"][1]["rayStartParams"]["num-cpus"] = 1
    errors = crd_errors(ray)
    assert any("minReplica" in e for e in errors), errors
    assert any("rayStartParams/num-cpus" in e for e in errors), errors
    with pytest.raises(Exception, match="No such option"):
        cli_params(["serve", "--pin-pool"])


# -- the parts point at each other ------------------------------------------------------------


def test_services_and_pdb_select_their_pods(rendered: Rendered) -> None:
    templates = rendered.pod_templates()
    for doc in rendered.docs:
        if doc["kind"] in WORKLOADS:
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for doc in rendered.docs:
        if doc["kind"] not in ("Service", "PodDisruptionBudget"):
            continue
        spec = doc["spec"]
        selector = spec["selector"] if doc["kind"] == "Service" else spec["selector"]["matchLabels"]
        owners = [
            owner
            for owner, t in templates.items()
            if selector.items() <= t["metadata"].get("labels", {}).items()
        ]
        assert owners == [doc["metadata"]["name"]], (doc["kind"], doc["metadata"]["name"], owners)
        if doc["kind"] == "Service":
            for port in spec["ports"]:
                assert port["targetPort"] in ports(templates[owners[0]]), port
    pdb = rendered.one("PodDisruptionBudget", "tandem-router")
    assert (
        pdb["spec"]["minAvailable"]
        < rendered.one("Deployment", "tandem-router")["spec"]["replicas"]
    )


def test_router_and_head_reach_redis_ray_and_the_same_model(rendered: Rendered) -> None:
    env = {**rendered.config, "TANDEM_ADMIN_TOKEN": "s3cret"}
    router = cli_params(tandem_argv(script(router_template(rendered)), env))
    head = cli_params(tandem_argv(script(head_template(rendered)), env))

    for params in (router, head):
        assert params["redis"] == rendered.config["TANDEM_REDIS_URL"]
        assert params["model"] == rendered.config["TANDEM_MODEL"]
        assert params["admin_token"] == "s3cret"

    # KubeRay names the head Service <RayCluster>-head-svc; the Ray client listens on the head
    # container's "client" port.
    ray_address = urlparse(router["ray_address"])
    assert ray_address.scheme == "ray"
    assert ray_address.hostname == f"{rendered.ray['metadata']['name']}-head-svc"
    assert ray_address.port == ports(head_template(rendered))["client"]
    assert (router["host"], router["http_port"], router["grpc_port"]) == ("0.0.0.0", 8000, 50051)
    assert ports(router_template(rendered)) == {"http": 8000, "grpc": 50051}

    # Without a token (no Secret), no --admin-token flag at all.
    no_token = cli_params(tandem_argv(script(router_template(rendered)), dict(rendered.config)))
    assert no_token["admin_token"] is None


def test_the_registry_url_names_every_sentinel_and_the_set_they_monitor(
    rendered: Rendered,
) -> None:
    """TANDEM_REDIS_URL, as tandem/registry.py reads it, lists each pod of the Redis StatefulSet
    by the DNS name its headless Service gives it, on the Sentinel port, and names the set the
    Sentinels monitor; the Redis pods find each other under the same names."""
    url = SentinelURL.parse(rendered.config["TANDEM_REDIS_URL"])
    redis_set = rendered.one("StatefulSet", "tandem-redis")
    service = rendered.one("Service", redis_set["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    pods = [
        f"{redis_set['metadata']['name']}-{i}.{service['metadata']['name']}"
        for i in range(redis_set["spec"]["replicas"])
    ]
    [sentinel_port] = [p["port"] for p in service["spec"]["ports"] if p["name"] == "sentinel"]
    assert url.sentinels == [(pod, sentinel_port) for pod in pods]
    assert (url.db, url.username, url.password) == (0, None, None)
    assert len(url.sentinels) >= 3, "a quorum of Sentinels survives one lost pod"

    containers = {c["name"]: c for c in redis_set["spec"]["template"]["spec"]["containers"]}
    sentinel = containers["sentinel"]["args"][0]
    [monitor] = re.findall(r"sentinel monitor (\S+) \S+ (\d+) (\d+)", sentinel)
    assert monitor[0] == url.service_name
    assert int(monitor[1]) == ports(redis_set["spec"]["template"])["redis"]
    assert int(monitor[2]) == len(pods) // 2 + 1  # the quorum: a majority
    assert "port 26379\n" in sentinel and sentinel_port == 26379
    for name, text in ((n, c["args"][0]) for n, c in containers.items()):
        hosts = set(re.findall(r"([a-z0-9-]+-\$i\.[a-z0-9-]+)", text.replace('"', "")))
        assert hosts == {f"{redis_set['metadata']['name']}-$i.{service['metadata']['name']}"}, name
        assert f'primary="{pods[0]}"' in text, name  # the first primary, before any failover
        assert "for i in 0 1 2;" in text and len(pods) == 3, name


def test_both_routers_read_the_api_key_from_an_optional_secret(rendered: Rendered) -> None:
    # The router reads $TANDEM_API_KEY itself (tandem/config.py): the key stays out of `ps`.
    for template in (router_template(rendered), head_template(rendered)):
        [key] = [e for e in container(template)["env"] if e["name"] == "TANDEM_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {
            "name": "tandem-api-key",
            "key": "key",
            "optional": True,
        }
        assert "--api-key" not in script(template)


def test_head_starts_ray_then_the_driver(rendered: Rendered) -> None:
    # KubeRay runs our commands unchanged only with this annotation; the workers then have to
    # run the generated `ray start` themselves, or they never join.
    assert rendered.ray["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    text = script(head_template(rendered))
    ray_start = text.index('eval "$KUBERAY_GEN_RAY_START_CMD" &')
    assert ray_start < text.index("ray health-check") < text.index('tandem "${args[@]}" &')
    for role in ROLES:
        assert 'eval "$KUBERAY_GEN_RAY_START_CMD"' in script(rendered.groups[role]["template"])
    for owner, template in rendered.pod_templates().items():
        if owner != "tandem-redis":
            subprocess.run(["bash", "-n", "-c", script(template)], check=True, timeout=10)
    for c in rendered.pod_templates()["tandem-redis"]["spec"]["containers"]:  # alpine: no bash
        assert c["command"] == ["/bin/sh", "-c", "--"], c["name"]
        subprocess.run(["sh", "-n", "-c", c["args"][0]], check=True, timeout=10)

    serve = cli_params(tandem_argv(text, dict(rendered.config)))
    assert serve["address"] == "auto"
    assert serve["host"] == "0.0.0.0"
    assert serve["pin_pools"] and serve["ray"] and not serve["demo"]
    assert serve["dtype"] == rendered.config["TANDEM_DTYPE"] == OVERLAYS[rendered.name]["dtype"]
    assert (serve["prefill"], serve["decode"]) == OVERLAYS[rendered.name]["workers"]
    assert serve["spec"] == (rendered.config["TANDEM_SPEC"] or None)
    assert serve["autoscale"] == (rendered.config["TANDEM_AUTOSCALE"] == "true")


def test_a_deleted_worker_pod_drains_its_worker_before_ray_stops(rendered: Rendered) -> None:
    """Its SIGTERM trap sends SIGTERM to the worker actor (which drains: WorkerActor), waits for
    it to exit, then stops Ray; the pod's grace period covers the drain timeout."""
    for role in ROLES:
        template = rendered.groups[role]["template"]
        [trap] = re.findall(r"^trap '(.*)' TERM$", script(template), re.MULTILINE)
        steps = [step.strip() for step in trap.split(";")]
        assert steps[0] == 'pkill -TERM -f "^ray::WorkerActor"', steps
        assert steps.index("ray stop") > steps.index("done"), steps
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > ClusterSpec("model", "redis://r").drain_timeout_s, role
    assert WorkerActor.__name__ == "WorkerActor"  # the process title `ray::WorkerActor`


def test_worker_groups_advertise_the_pool_resources(rendered: Rendered) -> None:
    nodes = autoscaler_node_types(rendered.ray)
    assert set(nodes) == {"headgroup", *ROLES}
    assert nodes["headgroup"]["resources"]["CPU"] == 0, "worker actors must not land on the head"
    assert not any(r.startswith("tandem_") for r in nodes["headgroup"]["resources"])
    for role in ROLES:
        custom = {r: n for r, n in nodes[role]["resources"].items() if r.startswith("tandem_")}
        assert custom == {f"tandem_{role}": 1}, role


def test_a_worker_bundle_fits_one_worker_pod(rendered: Rendered) -> None:
    """The placement group `tandem serve --pin-pools` creates per worker must fit a pod of its
    group as the Ray autoscaler sees it, or it stays pending for ever."""
    config, nodes = rendered.config, autoscaler_node_types(rendered.ray)
    for role, group in rendered.groups.items():
        pool = PoolSpec(
            float(config["TANDEM_CPUS_PER_WORKER"]),
            int(config["TANDEM_GPUS_PER_WORKER"]),
            resources={f"tandem_{role}": 1.0},
        )
        need: dict[str, float] = {}
        for bundle in pool.bundles():
            for k, v in bundle.items():
                need[k] = need.get(k, 0.0) + v
        offers = nodes[role]["resources"]
        assert all(need[k] <= offers.get(k, 0) for k in need), (role, need, offers)
        # Ray's CPUs are what Kubernetes reserves, so torch threads do not fight for cores.
        requests = container(group["template"])["resources"]["requests"]
        assert float(requests["cpu"]) >= offers["CPU"], role


def test_overlay_devices_dtype_and_image(rendered: Rendered) -> None:
    want = OVERLAYS[rendered.name]
    assert rendered.config["TANDEM_DTYPE"] == want["dtype"]
    assert int(rendered.config["TANDEM_GPUS_PER_WORKER"]) == want["gpus"]
    for role, group in rendered.groups.items():
        resources = container(group["template"])["resources"]
        for kind in ("requests", "limits"):  # Kubernetes wants both, equal, for GPUs
            assert int(resources[kind].get("nvidia.com/gpu", 0)) == want["gpus"], (role, kind)
    for owner in ("ray-head", "tandem-router"):
        resources = container(rendered.pod_templates()[owner])["resources"]
        assert "nvidia.com/gpu" not in resources.get("limits", {}), owner
    # One image for every Tandem container: the routers' Ray client must match the head.
    images = {
        owner: container(t)["image"]
        for owner, t in rendered.pod_templates().items()
        if owner != "tandem-redis"
    }
    assert set(images.values()) == {want["image"]}, images


def test_autoscaling_bounds(rendered: Rendered) -> None:
    ray, config = rendered.ray["spec"], rendered.config
    assert ray["enableInTreeAutoscaling"] is True
    defaults = AutoscalerConfig()
    nodes = autoscaler_node_types(rendered.ray)
    for role, group in rendered.groups.items():
        initial = int(config[f"TANDEM_{role.upper()}_WORKERS"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], role
        assert nodes[role]["max_workers"] == group["maxReplicas"], role
        assert initial <= group["maxReplicas"], f"{role}: the initial pool cannot be placed"
        if config["TANDEM_AUTOSCALE"] == "true":
            # Tandem's autoscaler may ask for up to max_<role> workers (not settable yet).
            assert group["maxReplicas"] >= getattr(defaults, f"max_{role}"), role
    # `tandem serve` has no SLO flags: the ConfigMap states what the autoscaler uses.
    assert float(config["TANDEM_SLO_TTFT_P90_S"]) == defaults.ttft_p90_slo_s
    assert float(config["TANDEM_SLO_TPOT_P90_S"]) == defaults.tpot_p90_slo_s


def test_config_values_are_ones_tandem_accepts(rendered: Rendered) -> None:
    config = rendered.config
    assert config["TANDEM_DTYPE"] in DTYPES
    SpecConfig(method=config["TANDEM_SPEC"] or None)
    assert {config["TANDEM_PREFILL_POLICY"], config["TANDEM_DECODE_POLICY"]} <= set(POLICIES)
    assert config["TANDEM_AUTOSCALE"] in ("true", "false")
    assert config["TANDEM_AUTOSCALE_DRY_RUN"] in ("true", "false")


def test_probes(rendered: Rendered) -> None:
    router = container(router_template(rendered))
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for c in rendered.pod_templates()["tandem-redis"]["spec"]["containers"]:
        assert "readinessProbe" in c and "livenessProbe" in c, c["name"]


# -- images -----------------------------------------------------------------------------------


def test_dockerfiles() -> None:
    ray_version = yaml.safe_load((DEPLOY / "base" / "raycluster.yaml").read_text())["spec"][
        "rayVersion"
    ]
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / name).read_text()
        assert f"ARG RAY_VERSION={ray_version}\n" in text, name
        assert "tandem models pull smollm2-135m" in text, name
        assert "TANDEM_HOME=" in text and "pip install ." in text, name
    cpu = (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    assert "download.pytorch.org/whl/cpu" in cpu
    # the native extension is built into the image, where every pod looks for it, and no
    # -march=native build depends on the build machine's CPU (native.py)
    assert cpu.count("TORCH_EXTENSIONS_DIR=/opt/tandem/torch_extensions") == 2
    assert "native.library()" in cpu and "COPY --from=builder /opt/tandem /opt/tandem" in cpu
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


# -- the renderer itself ----------------------------------------------------------------------


def test_json_patch_operations() -> None:
    doc: dict[str, Any] = {"a": {"b": [1, 2], "c/d": 0}}
    render.apply_operation(doc, {"op": "add", "path": "/a/b/-", "value": 3})
    render.apply_operation(doc, {"op": "add", "path": "/a/b/0", "value": 0})
    render.apply_operation(doc, {"op": "replace", "path": "/a/b/1", "value": 9})
    render.apply_operation(doc, {"op": "remove", "path": "/a/b/2"})
    render.apply_operation(doc, {"op": "replace", "path": "/a/c~1d", "value": 5})
    render.apply_operation(doc, {"op": "add", "path": "/e", "value": {"f": 1}})
    assert doc == {"a": {"b": [0, 9, 3], "c/d": 5}, "e": {"f": 1}}
    for op in (
        {"op": "replace", "path": "/missing", "value": 1},
        {"op": "remove", "path": "/a/b/7"},
        {"op": "move", "from": "/a", "path": "/b"},
    ):
        with pytest.raises((KeyError, IndexError, ValueError)):
            render.apply_operation(doc, op)


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(ValueError, match="namePrefix"):
        render.render(tmp_path)
