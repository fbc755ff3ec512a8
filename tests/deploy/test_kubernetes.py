"""deploy/kubernetes/ without a cluster: every object validates against the Kubernetes schemas
(kubernetes-validate ships them, strict: unknown fields fail), the ConfigMap's sentinel config
passes our loader, the Envoy bootstrap passes ``envoy --mode validate`` and keeps xds_server/envoy/envoy.yaml's
listener and ADS settings, and the objects refer to each other correctly (selectors, ports,
probes, ConfigMaps, the ServiceAccount and its Role, the sidecar's arguments)."""
from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deploy_checks import (
    ROOT,
    bootstrap_parts,
    envoy_validate,
    envoy_wheel_version,
    read_dockerfile,
    template_parts,
    xds_hosts,
)

from node_probe.cli import build_parser as agent_parser
from xds_server.config import parse_config, parse_hostport

K8S_VERSION = "1.33.0"  # schemas checked against; the manifests need 1.27+ (PDB unhealthyPodEvictionPolicy)
DIR = ROOT / "deploy" / "kubernetes"
NS = "llm"


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict]:
    """Every object in deploy/kubernetes/, by (kind, name)."""
    out: dict[tuple[str, str], dict] = {}
    for path in sorted(DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = doc
    return out


def _pod(objs, name: str) -> dict:
    return objs[("Deployment", name)]["spec"]["template"]


def _container(objs, deployment: str, name: str) -> dict:
    (c,) = [c for c in _pod(objs, deployment)["spec"]["containers"] if c["name"] == name]
    return c


def _port(container: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return p


def _sentinel_config(objs, tmp: Path) -> dict:
    """The ConfigMap's config, its admin.token_file pointed at a copy of the Secret's token in
    ``tmp`` (the Deployment mounts that Secret at the file's directory:
    test_admin_token_comes_from_the_secret)."""
    cfg = yaml.safe_load(objs[("ConfigMap", "xds-server-config")]["data"]["xds.yaml"])
    token = objs[("Secret", "xds-server-admin-token")]["stringData"]["token"]
    path = tmp / "token"
    path.write_text(token)
    cfg["admin"]["token_file"] = str(path)
    return cfg


def test_admin_token_comes_from_the_secret(objs, tmp_path):
    """Off loopback the admin port needs a token: the config reads it from the Secret."""
    raw = yaml.safe_load(objs[("ConfigMap", "xds-server-config")]["data"]["xds.yaml"])
    c = _container(objs, "xds-server", "xds-server")
    (secret_vol,) = [v["name"] for v in _pod(objs, "xds-server")["spec"]["volumes"]
                     if v.get("secret", {}).get("secretName") == "xds-server-admin-token"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert raw["admin"]["token_file"] == f"{mounts[secret_vol]}/token"
    assert parse_config(_sentinel_config(objs, tmp_path)).admin.token == "replace-me-with-a-random-token"


def _bootstrap_text(objs) -> str:
    return objs[("ConfigMap", "envoy-bootstrap")]["data"]["envoy.yaml"]


def test_every_object_validates_against_the_kubernetes_schemas(objs):
    assert {k for k, _ in objs} == {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                    "Deployment", "PodDisruptionBudget", "Service", "Secret"}
    for (kind, name), doc in objs.items():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == NS, (kind, name)
    # The validator can fail: a misspelt field in a pod spec is refused.
    bad = copy.deepcopy(objs[("Deployment", "xds-server")])
    bad["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_configmap_config_passes_the_loader_and_matches_the_deployment(objs, tmp_path):
    cfg = parse_config(_sentinel_config(objs, tmp_path))
    dep = objs[("Deployment", "xds-server")]
    assert dep["spec"]["replicas"] == 2
    c = _container(objs, "xds-server", "xds-server")
    assert _port(c, "grpc-ads") == parse_hostport(cfg.xds.listen)[1]
    assert _port(c, "http-admin") == parse_hostport(cfg.admin.listen)[1]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http-admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http-admin"}
    assert c["args"][-1] in {f'{m["mountPath"]}/xds.yaml' for m in c["volumeMounts"]}
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    pod = _pod(objs, "xds-server")["spec"]
    (cm,) = [v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v]
    assert cm == "xds-server-config"
    # The state file lives on the writable volume (the root filesystem is read-only).
    state_dir = cfg.state.path.rpartition("/")[0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert state_dir in {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}


def test_pods_run_as_the_images_non_root_users(objs):
    stages = read_dockerfile(ROOT / "Dockerfile")
    for deployment, container, target in (("xds-server", "xds-server", "xds-server"),
                                          ("vllm", "node-probe", "node-probe")):
        c = _container(objs, deployment, container)
        sc = {**_pod(objs, deployment)["spec"].get("securityContext", {}), **c.get("securityContext", {})}
        assert sc["runAsNonRoot"] is True
        assert f'{sc["runAsUser"]}:{sc["runAsGroup"]}' == stages[target].user
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["image"].split("/")[-1].split(":")[0] == target
    envoy = _pod(objs, "envoy")["spec"]
    assert envoy["securityContext"]["runAsNonRoot"] is True and envoy["securityContext"]["runAsUser"] != 0


def test_selectors_services_and_budgets_find_their_pods(objs):
    labels = {name: _pod(objs, name)["metadata"]["labels"]
              for kind, name in objs if kind == "Deployment"}
    for (kind, name), doc in objs.items():
        if kind == "Deployment":
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels[name].items(), name
        if kind == "PodDisruptionBudget":
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels[name].items(), name
            assert doc["spec"]["minAvailable"] < objs[("Deployment", name)]["spec"]["replicas"]
        if kind == "Service":
            (target,) = [d for d, lab in labels.items() if doc["spec"]["selector"].items() <= lab.items()]
            names = {p["name"] for c in _pod(objs, target)["spec"]["containers"] for p in c.get("ports", [])}
            for p in doc["spec"]["ports"]:
                assert p["targetPort"] in names, (name, p)
    assert objs[("Service", "xds-server-ads")]["spec"]["clusterIP"] == "None"  # DNS lists each replica


def test_discovery_rbac_and_selector_fit_the_pool(objs, tmp_path):
    pod = _pod(objs, "xds-server")["spec"]
    assert pod["serviceAccountName"] == "xds-server"
    binding = objs[("RoleBinding", "xds-server-pod-reader")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "xds-server", "namespace": NS}]
    role = objs[("Role", binding["roleRef"]["name"])]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    # The pool registers itself (discovery.agents); the commented alternative, pod discovery,
    # selects the vLLM pods and names their serving port.
    (cluster,) = _sentinel_config(objs, tmp_path)["clusters"]
    assert cluster["discovery"]["agents"]["allow"] == ["*"]
    text = objs[("ConfigMap", "xds-server-config")]["data"]["xds.yaml"]
    block = []
    for line in text[text.index("# kubernetes:"):].splitlines():
        if not line.lstrip().startswith("#"):
            break
        block.append(line.lstrip()[2:])  # "# " off each line keeps the block's indentation
    k8s = yaml.safe_load("\n".join(block))["kubernetes"]
    assert k8s["namespace"] == NS
    vllm = _pod(objs, "vllm")
    assert k8s["label_selector"].items() <= vllm["metadata"]["labels"].items()
    ports = {p["name"] for c in vllm["spec"]["containers"] for p in c["ports"]}
    assert k8s["target_port"] in ports


def test_sidecar_reaches_its_engine_on_localhost_with_valid_arguments(objs):
    engine = _container(objs, "vllm", "vllm")
    sidecar = _container(objs, "vllm", "node-probe")
    assert engine["image"].startswith("vllm/vllm-openai:v")
    assert engine["command"] == ["vllm", "serve"] and not engine["args"][0].startswith("-")
    engine_port = _port(engine, "http")
    assert f"--port={engine_port}" in engine["args"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    args = agent_parser().parse_args(sidecar["args"])
    assert args.engine_url == f"http://127.0.0.1:{engine_port}"
    assert args.engine_kind == "vllm"
    assert args.listen is None  # dial-in: no inbound port but the metrics
    ads = objs[("Service", "xds-server-ads")]
    assert ads["spec"]["clusterIP"] == "None"  # resolves to every replica: one stream to each
    (target,) = args.control_planes
    assert target == f"xds-server-ads.{NS}.svc.cluster.local:{ads['spec']['ports'][0]['port']}"
    assert args.cluster == "llm" and args.serving_address == f"$(POD_IP):{engine_port}"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in sidecar["env"]
    assert int(args.metrics_listen.rpartition(":")[2]) == _port(sidecar, "metrics")
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert args.node_id == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in sidecar["env"]


def test_envoy_bootstrap_validates_and_lists_the_replicas(objs, tmp_path):
    text = _bootstrap_text(objs)
    doc = yaml.safe_load(text)
    cfg = parse_config(_sentinel_config(objs, tmp_path))
    ads = objs[("Service", "xds-server-ads")]
    (ads_port,) = [p["port"] for p in ads["spec"]["ports"] if p["name"] == "grpc-ads"]
    assert xds_hosts(doc) == [(f"xds-server-ads.{NS}.svc.cluster.local", ads_port)]
    assert ads_port == parse_hostport(cfg.xds.listen)[1]
    assert next(c for c in doc["static_resources"]["clusters"] if c["name"] == "xds_cluster")["type"] == "STRICT_DNS"
    assert cfg.lrs.shed.classes.enabled  # the example sheds, batch first: its routes are the template's with classes
    assert bootstrap_parts(doc) == template_parts(cluster=cfg.clusters[0].name, classes=cfg.lrs.shed.classes)
    envoy = _container(objs, "envoy", "envoy")
    assert envoy["image"] == f"envoyproxy/envoy:v{envoy_wheel_version()}"
    assert _port(envoy, "http") == bootstrap_parts(doc)["llm_port"]
    (ready,) = [ln for ln in doc["static_resources"]["listeners"] if ln["name"] == "ready"]
    assert ready["address"]["socket_address"]["port_value"] == _port(envoy, "ready")
    assert doc["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"  # admin stays in the pod
    args = envoy["args"]
    assert args[args.index("-c") + 1] == "/etc/envoy/envoy.yaml"
    assert args[args.index("--service-node") + 1] == "$(POD_NAME)"
    out = envoy_validate(text, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
