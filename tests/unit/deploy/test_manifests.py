"""The Kubernetes manifests (deploy/k8s): every overlay rendered, validated against the Kubernetes
schemas offline, and checked against what the ``stageserve`` CLI really configures; the
Prometheus Operator's PodMonitor (deploy/k8s/monitoring) checked against the pods it scrapes.
Every replica is one pod of the one Deployment, with a container per role (prepare, device,
reclaim); the tests check that replicas, rollout and disruption budget always leave one ready.

Overlays are rendered by kustomize as ``kubectl kustomize`` (kubectl is on every machine of the
project). Where kubectl is missing, :func:`render` stands in: it implements the subset of kustomize
the manifests use (``resources``, ``patches`` with strategic-merge files, ``images``, ``namespace``),
fails on any other kustomization field, and a test checks it gives kustomize's output exactly.
Container args are expanded the way the kubelet does (``$(VAR)`` from the container's environment)
and parsed by ``stageserve.cli.build_parser()``, the parser the image's ``stageserve`` runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from stageserve.cli import build_parser
from stageserve.device_endpoints import parse_device_endpoints
from stageserve.server import ServiceServer

K8S_DIR = Path(__file__).resolve().parents[3] / "deploy" / "k8s"
OVERLAYS = ("cpu", "ascend", "cuda", "model-volume", "secure")
# The device's accelerator per overlay: (--backend, the extended resource it requests, or None).
ACCELERATORS = {"cpu": ("cpu", None), "ascend": ("npu", "huawei.com/Ascend910"), "cuda": ("cuda", "nvidia.com/gpu"),
                "model-volume": ("cpu", None), "secure": ("cpu", None)}
NAMESPACE = "stageserve"
# Oldest Kubernetes the manifests target (native gRPC probes are GA there) and the newest schema shipped.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
ROLES = ("prepare", "device", "reclaim")
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
WORKLOAD_KINDS = ("Deployment",)
REPLICA_LABELS = {NAME_LABEL: "stageserve", COMPONENT_LABEL: "replica"}

# ---------------------------------------------------------------------------------------------
# Minimal kustomize


KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "images", "namespace"}
# Strategic-merge keys of the list fields the patches touch; any other list is replaced whole.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def render(directory: Path) -> list[dict]:
    """Render the kustomization in ``directory`` to its list of manifests (like ``kustomize build``).

    Raises:
        AssertionError: the kustomization uses a field this renderer does not implement, or a patch
            matches no manifest or more than one.
    """
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unsupported, f"{directory}: kustomization fields {sorted(unsupported)} are not implemented by this test's renderer"
    manifests: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        manifests += render(path) if path.is_dir() else [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only file patches are implemented, got {patch}"
        for doc in yaml.safe_load_all((directory / patch["path"]).read_text()):
            targets = [m for m in manifests if (m["kind"], m["metadata"]["name"]) == (doc["kind"], doc["metadata"]["name"])]
            assert len(targets) == 1, f"patch {patch['path']}: {len(targets)} targets for {doc['kind']}/{doc['metadata']['name']}"
            targets[0].update(strategic_merge(targets[0], doc))
    for image in kustomization.get("images", []):
        for manifest in manifests:
            for container in pod_spec(manifest).get("containers", []) if manifest["kind"] in WORKLOAD_KINDS else []:
                if container["image"].split(":")[0] == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    if "namespace" in kustomization:
        for manifest in manifests:
            manifest["metadata"]["namespace"] = kustomization["namespace"]
    return manifests


def strategic_merge(base, patch, field: str = ""):
    """Merge ``patch`` into a copy of ``base``: maps recursively, lists of :data:`MERGE_KEYS`
    fields item by item on their key (patch items first, as kustomize orders them), other lists and
    scalars replaced; ``None`` deletes a key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            assert not str(key).startswith("$"), f"patch directive {key} is not implemented"
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        # kustomize's order: the patch's items (merged into the base item of the same key), then
        # the base's items the patch does not name.
        key = MERGE_KEYS[field]
        by_key = {item[key]: item for item in base}
        merged = [strategic_merge(by_key[item[key]], item) if item[key] in by_key else copy.deepcopy(item) for item in patch]
        named = {item[key] for item in patch}
        return merged + [copy.deepcopy(item) for item in base if item[key] not in named]
    return copy.deepcopy(patch)


# ---------------------------------------------------------------------------------------------
# Reading the rendered manifests


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def find(manifests: list[dict], kind: str, **labels: str) -> list[dict]:
    """Manifests of ``kind`` whose metadata labels include ``labels``."""
    return [m for m in manifests if m["kind"] == kind and all(m["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())]


def workload(manifests: list[dict]) -> dict:
    """The one Deployment: its pods are the replicas."""
    found = [m for m in manifests if m["kind"] in WORKLOAD_KINDS]
    assert len(found) == 1, f"expected one workload, found {len(found)}"
    return found[0]


def role_container(manifests: list[dict], role: str) -> dict:
    """The replica pod's container running ``role`` (named after it)."""
    found = [c for c in pod_spec(workload(manifests))["containers"] if c["name"] == role]
    assert len(found) == 1, f"expected one container named {role}, found {len(found)}"
    return found[0]


def container_env(manifests: list[dict], container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom ConfigMaps, then env."""
    config_maps = {m["metadata"]["name"]: m.get("data", {}) for m in manifests if m["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in config_maps, f"{container['name']}: envFrom names ConfigMap {name!r}, which is not rendered"
        env.update(config_maps[name])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["configMapKeyRef"]
            env[var["name"]] = config_maps[ref["name"]][ref["key"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command/args (``$$`` is a literal ``$``).

    Raises:
        AssertionError: a referenced variable is not defined (the kubelet would pass it on verbatim).
    """
    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(1) in env, f"{text!r} references $({match.group(1)}), which the container's environment lacks"
        return env[match.group(1)]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", substitute, text)


def parse_cli(argv: list[str]):
    """Parse ``stageserve ARGV`` with the real CLI parser; fail with argparse's own message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"stageserve rejects {argv}: {stderr.getvalue().strip()}")


def container_cli_args(manifests: list[dict], role: str):
    """The role's container args, expanded and parsed by the stageserve parser."""
    container = role_container(manifests, role)
    assert container.get("command") in (None, ["stageserve"]), f"{role}: command must be the image's entrypoint `stageserve`"
    env = container_env(manifests, container)
    argv = [expand(arg, env) for arg in container["args"]]
    assert argv[0] == role, f"the {role} container runs `stageserve {argv[0]}`"
    return parse_cli(argv)


def container_port(container: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert name in ports, f"{container['name']}: no container port named {name!r}"
    return ports[name]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if not {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Fixtures


def kustomize_build(directory: Path) -> list[dict]:
    """``kubectl kustomize DIRECTORY``: the manifests as kustomize itself renders them."""
    built = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, f"kustomize cannot build {directory}: {built.stderr.strip()}"
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    """(overlay name, its rendered manifests): by kustomize, or by :func:`render` without kubectl."""
    directory = K8S_DIR / "overlays" / request.param
    return request.param, kustomize_build(directory) if shutil.which("kubectl") else render(directory)


@pytest.fixture(scope="module")
def health_service_names() -> dict[str, str]:
    """The readiness names the services register with ServiceServer, from the services' own modules."""
    from stageserve.device.service import SERVICE_NAME as device
    from stageserve.prepare.service import SERVICE_NAME as prepare
    from stageserve.reclaim.service import SERVICE_NAME as reclaim

    return {"prepare": prepare, "device": device, "reclaim": reclaim}


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly_against_the_kubernetes_schema(overlay, version):
    name, manifests = overlay
    assert len(manifests) >= 7, f"{name}: rendered only {len(manifests)} manifests"
    problems = []
    for manifest in manifests:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            problems.append(f"{manifest['kind']}/{manifest['metadata']['name']} at {where}: {exc.message}")
    assert not problems, f"{name} overlay, Kubernetes {version}:\n" + "\n".join(problems)


def test_overlay_renders_every_component_into_the_namespace(overlay):
    name, manifests = overlay
    kinds = sorted((m["kind"], m["metadata"]["name"]) for m in manifests if m["kind"] != "NetworkPolicy")
    assert kinds == sorted([
        ("ConfigMap", "stageserve-flags"),
        ("Deployment", "stageserve"),
        ("PodDisruptionBudget", "stageserve"),
        ("Service", "stageserve-prepare"),
        *([("PersistentVolumeClaim", "stageserve-models")] if name == "model-volume" else []),
    ])
    assert {m["metadata"].get("namespace") for m in manifests} == {NAMESPACE}
    variant = "cpu" if name in ("model-volume", "secure") else name  # these overlays build on the cpu one
    assert sorted(c["name"] for c in pod_spec(workload(manifests))["containers"]) == sorted(ROLES)
    for container in pod_spec(workload(manifests))["containers"]:
        # The overlay's images entry replaced the base's bare name with a tagged image of its variant.
        repository, _, tag = container["image"].rpartition(":")
        assert repository.endswith("/stageserve") and tag.endswith(f"-{variant}")


@pytest.mark.parametrize("role", ROLES)
def test_container_args_are_accepted_by_stageserve(overlay, role):
    _, manifests = overlay
    args = container_cli_args(manifests, role)
    assert args.command == role
    assert args.host not in ("127.0.0.1", "localhost", "::1"), f"{role} listens on loopback: probes and peers cannot reach it"
    assert args.drain_timeout > 0
    assert args.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR")


@pytest.mark.parametrize("role", ROLES)
def test_probes_use_the_cli_port_and_health_service_names(overlay, role, health_service_names):
    _, manifests = overlay
    container = role_container(manifests, role)
    args = container_cli_args(manifests, role)
    assert container_port(container, f"grpc-{role}") == args.port
    # With TLS the probes use the plaintext health-only port (Kubernetes' gRPC probes cannot do TLS).
    port = args.port if args.tls_cert is None else args.health_port
    assert port is not None, f"{role}: serves TLS but no --health-port for the probes"
    if args.health_port is not None:
        assert container_port(container, f"health-{role}") == args.health_port
    probes = {kind: container[kind]["grpc"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {probe["port"] for probe in probes.values()} == {port}, f"{role}: probe ports {probes} differ from {port}"
    assert probes["readinessProbe"]["service"] == health_service_names[role]
    assert probes["livenessProbe"].get("service", "") == ""
    # Startup: readiness for the device (model loaded and warmed), the live server for the others
    # (their readiness also waits for peers, which must not get them restarted).
    expected_startup = health_service_names[role] if role == "device" else ""
    assert probes["startupProbe"].get("service", "") == expected_startup


def test_the_service_targets_prepare_in_every_replica(overlay):
    _, manifests = overlay
    pod_labels = workload(manifests)["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in find(manifests, "Service") if selects({"matchLabels": s["spec"]["selector"]}, pod_labels)]
    assert service["metadata"]["name"] == "stageserve-prepare" and "clusterIP" not in service["spec"]
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    args = container_cli_args(manifests, "prepare")
    assert set(ports) == {"grpc", "http"}  # the gRPC API and the OpenAI-compatible one: prepare's only
    assert ports["grpc"]["targetPort"] == "grpc-prepare" and ports["grpc"]["port"] == args.port
    assert ports["http"]["targetPort"] == "http" and ports["http"]["port"] == args.http_port
    assert container_port(role_container(manifests, "prepare"), "http") == args.http_port


def test_peers_are_dialled_in_their_own_pod(overlay):
    # A device serves one prepare and one reclaim: each replica's are its own containers, on loopback.
    _, manifests = overlay
    prepare, device, reclaim = (container_cli_args(manifests, role) for role in ROLES)
    assert prepare.device == reclaim.device == parse_device_endpoints(f"127.0.0.1:{device.port}")
    assert prepare.reclaim == f"127.0.0.1:{reclaim.port}"


@pytest.mark.parametrize("role", ROLES)
def test_termination_grace_outlasts_prestop_and_drain(overlay, role):
    _, manifests = overlay
    pods = workload(manifests)
    container = role_container(manifests, role)
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    stop_grace_s = inspect.signature(ServiceServer.run_until_stopped).parameters["grace_s"].default
    # Every service's drain (the device's: prepare letting go, steps in flight, outputs) shares one --drain-timeout.
    needed_s = float(pre_stop[1]) + container_cli_args(manifests, role).drain_timeout + stop_grace_s
    assert pod_spec(pods)["terminationGracePeriodSeconds"] > needed_s


@pytest.mark.parametrize("role", ROLES)
def test_pods_run_unprivileged_on_a_read_only_root(overlay, role):
    _, manifests = overlay
    spec, container = pod_spec(workload(manifests)), role_container(manifests, role)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "privileged" not in security and "add" not in security["capabilities"]
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp["name"])
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(container["resources"][kind]), f"{role}: {kind} must set cpu and memory"


def test_replicas_rollout_and_disruption_budget_always_leave_one_ready(overlay):
    """No single point of failure: two replicas at least; a rollout never has fewer than one ready
    (a surge pod first, or one replaced at a time where a surge would need a spare accelerator);
    node drains evict one at a time."""
    name, manifests = overlay
    pods = workload(manifests)
    replicas = pods["spec"]["replicas"]
    assert pods["kind"] == "Deployment" and replicas >= 2
    strategy = pods["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    surge, unavailable = strategy["rollingUpdate"]["maxSurge"], strategy["rollingUpdate"]["maxUnavailable"]
    assert replicas - unavailable >= 1, f"a rollout may leave {replicas - unavailable} ready replicas"
    _, accelerator = ACCELERATORS[name]
    assert (surge, unavailable) == ((0, 1) if accelerator else (1, 0))
    (budget,) = find(manifests, "PodDisruptionBudget")
    assert selects(budget["spec"]["selector"], pods["spec"]["template"]["metadata"]["labels"])
    available = budget["spec"]["minAvailable"] if "minAvailable" in budget["spec"] else replicas - budget["spec"]["maxUnavailable"]
    assert available >= 1 and budget["spec"].get("maxUnavailable", 1) == 1
    assert not find(manifests, "HorizontalPodAutoscaler")  # replicas are whole pipelines: scaled by hand


def ingress_allowed(manifests: list[dict], dest_role: str, port_name: str, source_labels: dict, source_namespace: str) -> bool:
    """NetworkPolicy semantics: may a pod (labels, namespace) open the port ``port_name`` of a
    replica's ``dest_role`` container? (Its own pod's containers reach it on loopback, unfiltered.)

    A pod selected by no ingress policy accepts everything; otherwise some rule of a selecting
    policy must allow both the peer and the port.
    """
    dest_labels = workload(manifests)["spec"]["template"]["metadata"]["labels"]
    port_number = container_port(role_container(manifests, dest_role), port_name)
    namespace_labels = {"kubernetes.io/metadata.name": source_namespace}

    def peer_allowed(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            in_namespace = selects(peer["namespaceSelector"], namespace_labels)
        else:
            in_namespace = source_namespace == NAMESPACE
        return in_namespace and selects(peer.get("podSelector", {}), source_labels)

    def port_allowed(ports: list[dict] | None) -> bool:
        return not ports or any(p.get("protocol", "TCP") == "TCP" and p.get("port") in (None, port_number, port_name) for p in ports)

    selecting = [p for p in find(manifests, "NetworkPolicy") if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"], dest_labels)]
    if not selecting:
        return True
    return any(
        port_allowed(rule.get("ports")) and (not rule.get("from") or any(peer_allowed(peer) for peer in rule["from"]))
        for policy in selecting for rule in policy["spec"].get("ingress", [])
    )


def test_network_policy_lets_only_prepare_be_reached_from_outside(overlay):
    _, manifests = overlay
    sources = {
        "another replica": (REPLICA_LABELS, NAMESPACE),
        "debug pod in the namespace": ({"run": "debug"}, NAMESPACE),
        "replica-labelled pod elsewhere": (REPLICA_LABELS, "clients"),
        "client elsewhere": ({"app": "client"}, "clients"),
        "prometheus": ({"app.kubernetes.io/name": "prometheus"}, "monitoring"),
    }
    may_reach = {
        ("prepare", "grpc-prepare"): set(sources),
        ("prepare", "http"): set(sources),
        # A replica's device and reclaim serve its own prepare, on the pod's loopback: no pod may open them.
        ("reclaim", "grpc-reclaim"): set(),
        ("device", "grpc-device"): set(),
        **{(role, f"metrics-{role}"): {"prometheus"} for role in ROLES},
    }
    for (dest, port), allowed in may_reach.items():
        reached = {name for name, (source_labels, namespace) in sources.items() if ingress_allowed(manifests, dest, port, source_labels, namespace)}
        assert reached == allowed, f"{dest}:{port} is reachable from {sorted(reached)}, expected {sorted(allowed)}"


def test_accelerator_overlays_put_the_device_on_its_accelerator(overlay):
    name, manifests = overlay
    container, spec = role_container(manifests, "device"), pod_spec(workload(manifests))
    args = container_cli_args(manifests, "device")
    backend, resource = ACCELERATORS[name]
    assert args.backend == backend
    if resource is not None:
        for kind in ("requests", "limits"):
            assert container["resources"][kind][resource] == "1"
        assert spec["nodeSelector"] and any(t["key"] == resource and t["effect"] == "NoSchedule" for t in spec["tolerations"])
        # The patch merged into the base container instead of replacing it.
        assert container["readinessProbe"]["grpc"]["service"] and container["args"][0] == "device"
        assert container["env"][0]["value"].startswith("/tmp/")  # caches under the writable /tmp
    else:
        assert "nodeSelector" not in spec and "tolerations" not in spec
        assert args.threads == int(container["resources"]["limits"]["cpu"])
    assert not set(container["resources"]["limits"]) - {"cpu", "memory", *([resource] if resource else [])}
    for role in ("prepare", "reclaim"):
        assert set(role_container(manifests, role)["resources"]["limits"]) == {"cpu", "memory"}


def test_replicas_spread_over_nodes(overlay):
    # The PodDisruptionBudget holds voluntary disruptions to one replica at a time; only a spread
    # keeps one node's drain or loss from taking both replicas.
    _, manifests = overlay
    pods = workload(manifests)
    pod_labels = pods["spec"]["template"]["metadata"]["labels"]
    by_key = {c["topologyKey"]: c for c in pod_spec(pods)["topologySpreadConstraints"]}
    hostname = by_key["kubernetes.io/hostname"]
    assert (hostname["maxSkew"], hostname["whenUnsatisfiable"]) == (1, "DoNotSchedule")
    assert selects(hostname["labelSelector"], pod_labels)
    assert pods["spec"]["replicas"] >= 2


def test_the_secure_overlay_turns_on_mutual_tls_keys_and_mounts_them_from_secrets(overlay):
    name, manifests = overlay
    for role in ROLES:
        args = container_cli_args(manifests, role)
        if name != "secure":
            assert args.tls_cert is None and args.health_port is None, f"{role}: the other overlays stay plaintext"
            continue
        container, spec = role_container(manifests, role), pod_spec(workload(manifests))
        files = [args.tls_cert, args.tls_key, args.tls_ca] + ([args.api_keys_file, args.admin_keys_file] if role == "prepare" else [])
        for path in files:  # every file the flags name comes from a read-only Secret mount
            mount = next(m for m in container["volumeMounts"] if str(path).startswith(m["mountPath"].rstrip("/") + "/"))
            assert mount.get("readOnly") is True
            assert "secret" in next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert (args.tls_server_name is not None) == (role != "device"), f"{role}: dials 127.0.0.1, not the certificates' name"


def test_every_pod_loads_the_model_of_the_flags(overlay):
    name, manifests = overlay
    for role in ROLES:
        model = container_cli_args(manifests, role).model
        container, spec = role_container(manifests, role), pod_spec(workload(manifests))
        if name != "model-volume":
            assert model == "", f"{role}: the base serves the embedded model"
            continue
        # Each of the three reads the model (weights, or the tokenizer): from a read-only mount of the claim.
        mount = next(m for m in container["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/"))
        assert mount.get("readOnly") is True
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        claim_name = volume["persistentVolumeClaim"]["claimName"]
        (claim,) = [m for m in find(manifests, "PersistentVolumeClaim") if m["metadata"]["name"] == claim_name]
        assert claim["spec"]["accessModes"] == ["ReadOnlyMany"], "replicas on several nodes mount it at once"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (kustomize) to compare with")
@pytest.mark.parametrize("name", OVERLAYS)
def test_fallback_renderer_gives_kustomizes_output(name):
    directory = K8S_DIR / "overlays" / name

    def by_name(manifests: list[dict]) -> dict:
        return {(m["kind"], m["metadata"]["name"]): m for m in manifests}

    assert by_name(render(directory)) == by_name(kustomize_build(directory))


def test_renderer_merges_patches_like_kustomize():
    base = {"spec": {"containers": [{"name": "a", "args": ["x", "y"], "env": [{"name": "K", "value": "1"}]}], "replicas": 1}}
    patch = {"spec": {"containers": [{"name": "a", "args": ["z"], "env": [{"name": "J", "value": "2"}]},
                                     {"name": "b", "image": "i"}], "replicas": None}}
    assert strategic_merge(base, patch) == {"spec": {"containers": [
        {"name": "a", "args": ["z"], "env": [{"name": "J", "value": "2"}, {"name": "K", "value": "1"}]},
        {"name": "b", "image": "i"},
    ]}}
    assert expand("--x=$(A) $$(A) $(A)", {"A": "1"}) == "--x=1 $(A) 1"
    with pytest.raises(AssertionError, match=r"\$\(B\)"):
        expand("--x=$(B)", {"A": "1"})


# ---------------------------------------------------------------------------------------------
# The Prometheus Operator's PodMonitor (a custom resource: no Kubernetes schema to validate against)


def test_pod_monitor_scrapes_every_pods_metrics_port(overlay):
    _, manifests = overlay
    monitoring = K8S_DIR / "monitoring"
    (monitor,) = kustomize_build(monitoring) if shutil.which("kubectl") else render(monitoring)
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    assert monitor["metadata"]["namespace"] == NAMESPACE  # a PodMonitor selects pods of its own namespace by default
    assert set(monitor["spec"]) == {"selector", "podMetricsEndpoints"}
    assert selects(monitor["spec"]["selector"], workload(manifests)["spec"]["template"]["metadata"]["labels"])
    endpoints = {endpoint["port"]: endpoint for endpoint in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) == {f"metrics-{role}" for role in ROLES}
    for role in ROLES:
        endpoint = endpoints[f"metrics-{role}"]
        assert container_port(role_container(manifests, role), endpoint["port"]) == container_cli_args(manifests, role).metrics_port
        assert endpoint["path"] == "/metrics"
        assert ingress_allowed(manifests, role, endpoint["port"], {NAME_LABEL: "prometheus"}, "monitoring")
        # component: the container's name, which is its role (prepare, device, reclaim).
        targets = {relabel["targetLabel"]: relabel["sourceLabels"] for relabel in endpoint["relabelings"]}
        assert targets == {"component": ["__meta_kubernetes_pod_container_name"], "pod": ["__meta_kubernetes_pod_name"]}


def test_the_replica_pod_is_guaranteed_with_whole_cores(overlay):
    """Issue 20: the device's compute threads get cores of their own (requests = limits, integer CPUs,
    in every container of its pod: the static CPU manager pins only Guaranteed pods)."""
    _, manifests = overlay
    for container in pod_spec(workload(manifests))["containers"]:
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests == limits, "Guaranteed QoS needs requests equal to limits for every resource"
        assert str(limits["cpu"]).isdigit() and int(limits["cpu"]) >= 1, "whole cores"
