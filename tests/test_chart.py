"""The Helm chart (charts/slipstream), rendered by Helm's own engine (helm-python-sdk: Helm's Go
SDK behind a C ABI) for the default values and each file in tests/chart/: lint is clean, every
object passes Kubernetes' schemas, bad values are refused, and the operator's RBAC is exactly
what its code calls (collected by tests/chart/operator_api.py).
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import pathlib
import re
import sys
import tomllib
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from slipstream.operator import resources as operator_resources
from slipstream.operator.cli import build_parser, operator_arguments
from slipstream.operator.spec import DEFAULT_IMAGE, parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "slipstream"
VALUE_FILES = {p.stem: p for p in sorted((ROOT / "tests" / "chart").glob("*.yaml"))}
CASES = ["defaults", *VALUE_FILES]
RELEASE, NAMESPACE = "slipstream", "slipstream-system"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; CEL in CRDs) and the newest
# kubernetes-validate knows.
VERSIONS = ("1.25", "1.37")


def _load(name: str, path: pathlib.Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


api = _load("operator_api", ROOT / "tests" / "chart" / "operator_api.py")
restricted_violations = _load("pod_security", ROOT / "tests" / "operator" / "pod_security.py"
                              ).restricted_violations


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def values_of(case: str) -> dict[str, Any]:
    return {} if case == "defaults" else yaml.safe_load(VALUE_FILES[case].read_text())


@functools.cache
def render(case: str) -> tuple[tuple[dict[str, Any], ...], str]:
    """(objects, NOTES.txt) of the chart installed with ``case``'s values."""
    with helm.Chart.load(CHART) as loaded:
        files = loaded.render(values_of(case), name=RELEASE, namespace=NAMESPACE, is_install=True)
    notes = next(text for path, text in files.items() if path.endswith("NOTES.txt"))
    objects = [doc for path, text in sorted(files.items()) if not path.endswith(".txt")
               for doc in yaml.safe_load_all(text) if doc]
    return tuple(objects), notes


def objects_of(case: str, kind: str | None = None) -> list[dict[str, Any]]:
    return [copy.deepcopy(o) for o in render(case)[0] if kind in (None, o["kind"])]


def merged_values(case: str) -> dict[str, Any]:
    with helm.Chart.load(CHART) as loaded:
        return loaded.merge_values(values_of(case))


def operator_container(case: str) -> dict[str, Any]:
    (deployment,) = objects_of(case, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# ---- lint, schemas ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean_in_strict_mode(case, version):
    report = helm.lint(CHART, values_of(case), strict=True, namespace=NAMESPACE,
                       kube_version=f"v{version}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 1 is info ("icon")
    assert report["errors"] == [] and problems == []


# ServiceMonitor (monitoring.coreos.com/v1) is a Prometheus Operator CRD that kubernetes-validate
# does not know: checked against this subset of its schema, closed (unknown fields fail).
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "targetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object",
                                    "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False, "maxProperties": 1,
                    "properties": {"any": {"type": "boolean"}, "matchNames": {
                        "type": "array", "items": {"type": "string"}, "minItems": 1}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                        "scrapeTimeout": {"type": "string",
                                          "pattern": "^([0-9]+(ms|s|m|h))+$"}}}},
            },
        },
    },
}


@functools.cache
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservice.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate_object(obj: dict[str, Any], version: str) -> None:
    if obj["kind"] == "ServiceMonitor":
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
    elif obj["apiVersion"] == operator_resources.API_VERSION:
        # The CRD's own schema (OpenAPI v3.0 is draft-4-like), then the operator's rules.
        jsonschema.Draft4Validator(crd_schema()).validate(obj)
        parse_spec(obj["spec"], name=obj["metadata"]["name"])
    else:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_rendered_objects_pass_kubernetes_validate_strict(case, version):
    objects = objects_of(case)
    assert "Deployment" in {o["kind"] for o in objects}
    for obj in objects:
        validate_object(obj, version)


def test_a_wrong_field_fails_validation():
    """The validators above do reject: a typo in the Deployment, a ServiceMonitor and an
    InferenceService."""
    (deployment,) = objects_of("defaults", "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(deployment, VERSIONS[-1])
    (monitor,) = objects_of("servicemonitor", "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "1m"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(monitor, VERSIONS[-1])
    (isvc,) = objects_of("gpu", "InferenceService")
    isvc["spec"]["resources"]["gpus"] = -1
    with pytest.raises(jsonschema.ValidationError):
        validate_object(isvc, VERSIONS[-1])


BAD_VALUES = {
    "unknown-key": ({"replicaCount": 2}, "additional properties 'replicaCount'"),
    "nested-typo": ({"operator": {"resyncSecond": 5}}, "resyncSecond"),
    "namespace-not-a-label": ({"watchNamespaces": ["ML_team"]}, "/watchNamespaces/0"),
    "namespace-glob": ({"watchNamespaces": ["ml-*"]}, "/watchNamespaces/0"),
    "namespace-twice": ({"watchNamespaces": ["ml", "ml"]}, "/watchNamespaces"),
    "namespaces-not-a-list": ({"watchNamespaces": "ml"}, "/watchNamespaces"),
    "pull-policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "resync-zero": ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
    "health-port-privileged": ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
    "verbose-string": ({"operator": {"verbose": "yes"}}, "/operator/verbose"),
    "root-uid": ({"runAsUser": 0}, "/runAsUser"),
    "cpu-not-a-quantity": ({"resources": {"requests": {"cpu": "lots"}}},
                           "/resources/requests/cpu"),
    "sa-without-name": ({"serviceAccount": {"create": False, "name": ""}},
                        "/serviceAccount/name"),
    "monitor-interval": ({"serviceMonitor": {"interval": "15"}}, "/serviceMonitor/interval"),
    "example-name": ({"exampleInferenceService": {"name": "Chat_1"}},
                     "/exampleInferenceService/name"),
    "peering-name": ({"peering": {"name": "Leader Election"}}, "/peering/name"),
}


@pytest.mark.parametrize("values,needle", BAD_VALUES.values(), ids=BAD_VALUES)
def test_bad_values_are_rejected_by_the_schema(chart, values, needle):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert needle in str(caught.value)


def test_every_value_has_a_comment():
    """A key with a comment above it documents its subtree; a key without one (a section) needs
    each of its children documented."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented, covered_below = [], None  # indent under which a comment covers all keys
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([\w.-]+):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        if covered_below is not None and indent > covered_below:
            continue
        covered_below = None
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if above.startswith("#"):
            covered_below = indent
        elif rest and not rest.startswith("#"):
            undocumented.append(key)
    assert undocumented == []


def test_defaults_are_in_the_schema_and_the_schema_is_closed(chart):
    schema = chart.schema
    assert schema["additionalProperties"] is False
    assert set(chart.values) <= set(schema["properties"])
    chart.validate_schema(chart.values)


# ---- versions, CRDs, images ----------------------------------------------------------------

def test_app_version_is_the_package_version_and_the_operators_image_tag(chart):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart.metadata["appVersion"] == version
    assert DEFAULT_IMAGE == f"ghcr.io/slipstream-dev/slipstream:{version}"
    assert crd_schema()["properties"]["spec"]["properties"]["image"]["default"] == DEFAULT_IMAGE
    assert operator_container("defaults")["image"] == \
        f"ghcr.io/slipstream-dev/slipstream-operator:{version}"


def test_chart_crds_are_the_repository_crds(chart):
    ours = {p.name: p.read_bytes() for p in (ROOT / "crds").glob("*.yaml")}
    shipped = {p.name: p.read_bytes() for p in (CHART / "crds").glob("*.yaml")}
    assert set(shipped) == set(ours) == {"inferenceservice.yaml", "kopf-peering.yaml"}
    for name in ours:
        assert shipped[name] == ours[name], \
            f"charts/slipstream/crds/{name} differs from crds/{name}: make crds writes both " \
            f"inferenceservice.yaml files; cp crds/kopf-peering.yaml charts/slipstream/crds/"
    names = {yaml.safe_load(doc)["metadata"]["name"] for c in chart.crds
             for doc in c["data"].split("\n---\n")}
    assert names == {"inferenceservices.slipstream.dev", "kopfpeerings.kopf.dev",
                     "clusterkopfpeerings.kopf.dev"}


# ---- the operator's Deployment ---------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_operator_runs_once_hardened_with_a_liveness_probe(case):
    (deployment,) = objects_of(case, "Deployment")
    spec, pod = deployment["spec"], deployment["spec"]["template"]["spec"]
    container = operator_container(case)
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert spec["selector"]["matchLabels"].items() <= \
        spec["template"]["metadata"]["labels"].items()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert restricted_violations(pod) == []  # PodSecurity "restricted" admits it
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "privileged": False, "capabilities": {"drop": ["ALL"]}}
    assert container["resources"]["requests"].keys() == {"cpu", "memory"}
    assert "memory" in container["resources"]["limits"]
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    probe = container["livenessProbe"]["httpGet"]
    (port,) = [p for p in container["ports"] if p["name"] == probe["port"]]
    args = build_parser().parse_args(container["args"][1:])
    assert args.liveness == f"http://0.0.0.0:{port['containerPort']}{probe['path']}"
    want_uid = merged_values(case).get("runAsUser")  # null: Helm drops the key
    assert pod["securityContext"].get("runAsUser") == want_uid


@pytest.mark.parametrize("case", CASES)
def test_operator_arguments_match_the_values(case):
    """The rendered command line parses with the operator's own parser, and kopf is started
    cluster-wide or on exactly the watched namespaces, with peering as asked."""
    values = merged_values(case)
    container = operator_container(case)
    assert container["command"] == ["slipstream"] and container["args"][:2] == ["operator", "run"]
    args = build_parser().parse_args(container["args"][1:])
    kopf_args = operator_arguments(args)
    watched = values["watchNamespaces"]
    assert kopf_args["clusterwide"] is (not watched)
    assert kopf_args["namespaces"] == watched
    assert kopf_args["standalone"] is (not values["peering"]["enabled"])
    assert kopf_args["peering_name"] == (values["peering"]["name"]
                                         if values["peering"]["enabled"] else None)
    assert args.resync_seconds == values["operator"]["resyncSeconds"]
    assert args.cluster_domain == values["operator"]["clusterDomain"]
    assert args.verbose is values["operator"]["verbose"]


# ---- RBAC ------------------------------------------------------------------------------------

def effective_grants(objects: list[dict[str, Any]], account: str, namespace: str,
                     ) -> set[tuple[str, Any]]:
    """(scope, Permission) the ServiceAccount holds: scope '*' for a ClusterRoleBinding,
    else the RoleBinding's namespace."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("Role", "ClusterRole")}
    grants = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if subject not in binding["subjects"]:
            continue
        ref, scope = binding["roleRef"], binding["metadata"].get("namespace") or "*"
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            assert rule.keys() == {"apiGroups", "resources", "verbs"}, rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert "*" not in (group, resource, verb), rule
                        grants.add((scope, api.Permission(group, resource, verb)))
    return grants


def rbac_problems(objects: list[dict[str, Any]], account: str, *, watched: list[str],
                  peering: bool) -> tuple[list[str], list[str]]:
    """(missing, extra): calls the grants do not cover, grants no call needs."""
    needed = api.required(clusterwide=not watched, peering=peering)
    grants = effective_grants(objects, account, NAMESPACE)
    # The Lease: exactly in the operator's own namespace (not in watched ones, not cluster-wide).
    lease = api.lease_required(peering=peering)
    leased = {(scope, p) for scope, p in grants if (p.group, p.resource) == api.LEASE}
    grants -= leased
    lease_missing = [f"{p} in {NAMESPACE}" for p in sorted(lease) if (NAMESPACE, p) not in leased]
    lease_extra = [f"{p} in {scope}" for scope, p in sorted(leased, key=str)
                   if scope != NAMESPACE or p not in lease]
    scopes = watched or ["*"]
    missing = [f"{p} in {scope}" for p in sorted(needed)
               for scope in (["*"] if p.cluster_scoped else scopes)
               if ("*", p) not in grants and (scope, p) not in grants]
    extra = [f"{p} in {scope}" for scope, p in sorted(grants, key=str)
             if p not in needed or (scope != "*" if p.cluster_scoped or not watched
                                     else scope not in watched)]
    return missing + lease_missing, extra + lease_extra


@pytest.mark.parametrize("case", CASES)
def test_rbac_covers_every_operator_call_and_nothing_more(case):
    values = merged_values(case)
    objects = objects_of(case)
    (deployment,) = objects_of(case, "Deployment")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    missing, extra = rbac_problems(objects, account, watched=values["watchNamespaces"],
                                   peering=values["peering"]["enabled"])
    assert missing == [] and extra == []
    namespaced = [o for o in objects if o["kind"] in ("Role", "RoleBinding")
                  and not o["metadata"]["name"].endswith("-operator-lease")]
    assert sorted({o["metadata"]["namespace"] for o in namespaced}) == \
        sorted(values["watchNamespaces"])


def test_rbac_check_fails_on_a_missing_and_on_an_extra_rule():
    objects = objects_of("namespaced")
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["events"]]
    role["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
    missing, extra = rbac_problems(objects, RELEASE, watched=["ml", "research"], peering=True)
    assert missing == ["Permission(group='', resource='events', verb='create') in ml"]
    assert extra == ["Permission(group='', resource='secrets', verb='get') in ml"]


def test_rbac_off_renders_no_rbac_objects():
    with helm.Chart.load(CHART) as loaded:
        files = loaded.render({"rbac": {"create": False}}, name=RELEASE, namespace=NAMESPACE)
    kinds = {doc["kind"] for path, text in files.items() if not path.endswith(".txt")
             for doc in yaml.safe_load_all(text) if doc}
    assert kinds == {"Deployment", "ServiceAccount"}


def test_collector_sees_a_new_call(tmp_path):
    """Adding a call to the operator changes what the RBAC test demands; a call it cannot map
    stops it."""
    added = tmp_path / "autoscale.py"
    added.write_text("async def tick(memo, ns, sel):\n"
                     "    pods = await memo.kube.list(PODS, ns, sel)\n"
                     "    await memo.kube.merge_patch(INFERENCESERVICES, ns, 'x', {},"
                     " subresource='scale')\n")
    found = {p for _, p in api.client_calls([added])}
    assert found == {api.Permission("", "pods", "list"),
                     api.Permission("slipstream.dev", "inferenceservices/scale", "patch")}
    for source in ("async def f(kube, r):\n    await kube.get(r, 'ns', 'x')\n",
                   "async def f(kube):\n    await kube.request('DELETE', '/api/v1/pods')\n",
                   "async def f(memo):\n    await memo.kube.evict(PODS, 'ns', 'x')\n"):
        added.write_text(source)
        with pytest.raises(api.CollectionError):
            list(api.client_calls([added]))


def test_collector_follows_a_function_that_picks_the_workload_resource(tmp_path):
    """A call on workload_resource(spec)'s pick (Deployment or LeaderWorkerSet) asks for both."""
    added = tmp_path / "scale.py"
    added.write_text("async def scale(kube, spec, ns):\n"
                     "    await kube.get(workload_resource(spec)[0], ns, 'x')\n"
                     "    workload, _ = workload_resource(spec)\n"
                     "    await kube.merge_patch(workload, ns, 'x', {})\n")
    found = {p for _, p in api.client_calls([added])}
    assert found == {api.Permission("apps", "deployments", "get"),
                     api.Permission("leaderworkerset.x-k8s.io", "leaderworkersets", "get"),
                     api.Permission("apps", "deployments", "patch"),
                     api.Permission("leaderworkerset.x-k8s.io", "leaderworkersets", "patch")}


def test_the_gateways_role_grants_exactly_what_the_gateway_calls_and_the_operator_holds_it():
    """The Role the operator renders for each gateway (server/gateway/ lists and watches
    EndpointSlices) and nothing more; the API server refuses to let the operator create it
    unless the operator holds those permissions itself (RBAC escalation prevention), in every
    mode of the chart."""
    calls = {p for _, p in api.gateway_calls()}
    assert calls == {api.Permission("discovery.k8s.io", "endpointslices", verb)
                     for verb in ("list", "watch")}
    assert api.granted() == calls
    for case in CASES:
        values = merged_values(case)
        if not values["rbac"]["create"]:
            continue
        (deployment,) = objects_of(case, "Deployment")
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        grants = effective_grants(objects_of(case), account, NAMESPACE)
        for scope in values["watchNamespaces"] or ["*"]:
            assert all((scope, p) in grants or ("*", p) in grants for p in calls), (case, scope)


def test_gateway_call_collection_sees_a_new_call_and_stops_at_one_it_cannot_map(tmp_path):
    added = tmp_path / "leases.py"
    added.write_text("def f(api, core, ns):\n"
                     "    api.read_namespaced_endpoint_slice('x', ns)\n"
                     "    watch.Watch().stream(core.list_namespaced_pod, ns)\n")
    assert {p for _, p in api.gateway_calls([added])} == {
        api.Permission("discovery.k8s.io", "endpointslices", "get"),
        api.Permission("", "pods", "list"), api.Permission("", "pods", "watch")}
    added.write_text("def f(api, ns):\n    api.list_namespaced_secret(ns)\n")
    with pytest.raises(api.CollectionError):
        list(api.gateway_calls([added]))


# ---- ServiceMonitor, example, NOTES --------------------------------------------------------

def test_service_monitor_selects_the_services_the_operator_creates():
    (monitor,) = objects_of("servicemonitor", "ServiceMonitor")
    service = operator_resources.render_service({"metadata": {"name": "chat",
                                                              "namespace": "ml"}})
    spec = monitor["spec"]
    assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in spec["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    assert spec["endpoints"][0]["path"] == "/metrics"
    assert spec["namespaceSelector"] == {"matchNames": ["ml"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert objects_of("defaults", "ServiceMonitor") == []


def test_example_inference_service_is_off_by_default_and_valid_when_on():
    assert objects_of("defaults", "InferenceService") == []
    (isvc,) = objects_of("standalone", "InferenceService")
    assert isvc["metadata"] == {**isvc["metadata"], "name": "smollm2", "namespace": NAMESPACE}
    assert parse_spec(isvc["spec"], name="smollm2").model.source == "builtin"


@pytest.mark.parametrize("case", CASES)
def test_notes_say_what_to_do_next(case):
    notes = render(case)[1]
    values = merged_values(case)
    for step in ("rollout status", "get infsvc", "port-forward svc/", "/v1/chat/completions",
                 "/metrics", "helm uninstall"):
        assert step in notes, step
    namespace = (values["watchNamespaces"] or ["default"])[0]
    if values["exampleInferenceService"]["enabled"]:
        namespace = NAMESPACE
    assert f"kubectl -n {namespace} get infsvc" in notes
