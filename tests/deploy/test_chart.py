"""The Helm chart (deploy/helm/narwhal): `helm lint --strict` by Helm's own library, every
rendered manifest checked against the official Kubernetes client's models, and the router's
config and credentials as the chart wires them accepted by Narwhal itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes.client import ApiClient

from narwhal.config.root import parse_config
from narwhal.config.secrets import load_secrets

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "narwhal"
EVERYTHING: dict[str, Any] = {
    "replicaCount": 3,
    "workers": 4,
    "preflight": False,
    "credentials": {"clientApiKeys": "c1,c2", "adminApiKeys": "a1", "engineApiKey": "e1"},
    "serviceMonitor": {"enabled": True},
    "config": {"server": {"graceful_timeout_s": 60}},
}
EXISTING: dict[str, Any] = {
    "credentials": {"existingSecret": {"name": "keys", "adminApiKeys": True}},
}
DISCOVERY: dict[str, Any] = {
    "discovery": {"enabled": True, "namespace": "engines", "settings": {"port_name": "http"}},
    "config": {"engines": []},
}


def render(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rendered manifests by kind."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="demo", namespace="serving")
    manifests: dict[str, dict[str, Any]] = {}
    for text in out.values():
        for doc in yaml.safe_load_all(text):
            if doc:
                assert doc["kind"] not in manifests, doc["kind"]
                manifests[doc["kind"]] = doc
    return manifests


def round_trip(document: dict[str, Any]) -> Any:
    """The manifest as the official client's model reads and writes it: a misspelt or
    misplaced field is dropped, a wrongly typed one changed."""
    api = ApiClient()
    version = document["apiVersion"].split("/")[-1].capitalize()
    model = api.deserialize(
        json.dumps(document), f"{version}{document['kind']}", "application/json"
    )
    return api.sanitize_for_serialization(model)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("values", [{}, DISCOVERY], ids=["defaults", "discovery"])
def test_helm_lint_strict_finds_nothing_wrong(values: dict[str, Any]) -> None:
    report = helm.lint(str(CHART), values, strict=True)
    assert report["errors"] == []
    # Severity 1 is information ("icon is recommended"); 2 and up are warnings or errors.
    assert [m for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize(
    "values",
    [{}, EVERYTHING, EXISTING, DISCOVERY],
    ids=["defaults", "all", "existing", "discovery"],
)
def test_every_manifest_is_a_valid_kubernetes_object(values: dict[str, Any]) -> None:
    for kind, document in render(values).items():
        if kind == "ServiceMonitor":  # a CRD: checked by its own test below
            continue
        assert round_trip(document) == document, kind


def test_the_defaults_render_the_router_and_its_service_budget_and_account() -> None:
    kinds = set(render({}))
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ServiceAccount"}
    assert {"Secret", "ServiceMonitor"} <= set(render(EVERYTHING))


def test_the_config_the_chart_writes_is_one_narwhal_accepts() -> None:
    manifests = render(EVERYTHING)
    config = parse_config(json.loads(manifests["ConfigMap"]["data"]["fleet.json"]), "chart")
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8000)
    # Every replica takes its part of the seat limits.
    assert config.server.replicas == 3
    # Each credential the config names comes from the Secret as that variable.
    container = manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in container["env"]}
    secret = manifests["Secret"]["stringData"]
    environ = {name: secret[ref["key"]] for name, ref in env.items()}
    secrets = load_secrets(config, environ)
    assert secrets.client_keys == (b"c1", b"c2") and secrets.admin_keys == (b"a1",)
    assert secrets.engine_key == "e1"


def test_an_existing_secret_supplies_only_the_keys_it_is_said_to_have() -> None:
    manifests = render(EXISTING)
    assert "Secret" not in manifests
    config = parse_config(json.loads(manifests["ConfigMap"]["data"]["fleet.json"]), "chart")
    assert config.server.admin_api_keys_env == "NARWHAL_ADMIN_API_KEYS"
    assert config.server.api_keys_env is None and config.engine.api_key_env is None
    container = manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert [e["valueFrom"]["secretKeyRef"] for e in container["env"]] == [
        {"name": "keys", "key": "admin-api-keys"}
    ]


def test_the_deployment_runs_workers_unprivileged_and_probes_health() -> None:
    manifests = render(EVERYTHING)
    deployment = manifests["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 3
    assert container["args"] == [
        *("serve", "--config", "/etc/narwhal/fleet.json", "--workers", "4", "--skip-preflight")
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["livenessProbe"]["tcpSocket"] == {"port": "http"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Workers drain for graceful_timeout_s before Kubernetes would kill them.
    assert pod["terminationGracePeriodSeconds"] > 60


def test_service_budget_and_monitor_select_the_routers_pods() -> None:
    manifests = render(EVERYTHING)
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert manifests["Service"]["spec"]["selector"].items() <= labels.items()
    assert manifests["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    monitor = manifests["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        manifests["Service"]["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == manifests["Service"]["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"]["key"] == "admin-api-keys"


def test_discovery_reads_pods_with_its_own_token_and_a_read_only_role() -> None:
    manifests = render(DISCOVERY)
    config = parse_config(json.loads(manifests["ConfigMap"]["data"]["fleet.json"]), "chart")
    found = config.discovery
    assert found.enabled and config.engines == ()
    assert (found.namespace, found.credentials.value, found.port_name) == (
        "engines",
        "in_cluster",
        "http",
    )
    assert found.label_selector == "app.kubernetes.io/component=vllm-engine"
    account = manifests["ServiceAccount"]
    assert account["automountServiceAccountToken"] is True
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is True
    role, binding = manifests["Role"], manifests["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "engines"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": "serving",
        }
    ]


def test_without_discovery_no_rbac_and_no_token() -> None:
    manifests = render({})
    assert not {"Role", "RoleBinding"} & set(manifests)
    assert manifests["ServiceAccount"]["automountServiceAccountToken"] is False
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
