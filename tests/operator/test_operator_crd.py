"""The CRD itself, and InferenceService files checked against it without a cluster.

Three layers reject a bad InferenceService: the structural schema (checked here with
jsonschema), the CEL rules (``x-kubernetes-validations``, evaluated here with the
``common-expression-language`` package as the API server would), and the operator's own
``parse_spec`` (which repeats both, for servers without CEL, and adds what neither can say).
"""
from __future__ import annotations

import pathlib
from typing import Any, Iterator

import cel
import jsonschema
import kubernetes_validate
import pytest
import yaml

from invalid_specs import INVALID, header
from operator_helpers import EXAMPLES
from kube_emulator import KUBERNETES_VERSION, schema_defaults
from slipstream.api_types.autoscaling import CRD_KEYS
from slipstream.operator.render import render_children
from slipstream.operator.spec import SpecError, parse_spec


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    """jsonschema's verdict (OpenAPI v3.0 is draft-4-like: boolean exclusiveMinimum)."""
    return [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]


def cel_rules(schema: dict[str, Any], value: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """(rule, self) for every CEL rule that applies to ``value``, as the API server walks."""
    for rule in schema.get("x-kubernetes-validations") or ():
        yield rule, value
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                yield from cel_rules(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            yield from cel_rules(schema["items"], item)


def cel_violations(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    return [rule["message"] for rule, value in cel_rules(schema, obj)
            if cel.evaluate(rule["rule"], {"self": value}) is not True]


def walk_schema(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk_schema(sub, f"{path}.{key}")
    if "items" in schema:
        yield from walk_schema(schema["items"], f"{path}[]")


def default_problems(schema: dict[str, Any]) -> list[str]:
    """What the API server refuses when it admits the CRD: each field's ``default`` exactly as
    written (its own nested defaults NOT applied first) must pass that field's schema and every
    CEL rule of it and of the fields the default holds. One line per refusal."""
    problems = []
    for path, node in walk_schema(schema):
        if "default" not in node:
            continue
        default = node["default"]
        problems += [f"{path}.default: {m}" for m in schema_errors(node, default)]
        for rule, value in cel_rules(node, default):
            try:
                verdict = cel.evaluate(rule["rule"], {"self": value})
            except Exception as exc:  # the server's "no such key" is a KeyError here
                verdict = f"{type(exc).__name__}: {exc}"
            if verdict is not True:
                problems.append(f"{path}.default {default!r}: {verdict} evaluating rule: "
                                f"{rule['rule']}")
    return problems


def test_every_cel_rule_holds_for_its_fields_default_as_written(crd_schema):
    """A real kube-apiserver refused the CRD for `default: {}` on objects whose rules read
    their fields ("no such key")."""
    assert sum("default" in node for _, node in walk_schema(crd_schema)) >= 25
    assert default_problems(crd_schema) == []


def test_the_default_check_catches_an_empty_default_under_a_rule():
    node = {"type": "object", "properties": {"spec": {
        "type": "object", "default": {},
        "properties": {"a": {"type": "integer", "default": 1}, "b": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.a <= self.b", "message": "a ≤ b"}]}}}
    [problem] = default_problems(node)
    assert problem.startswith(".spec.default {}: KeyError")
    node["properties"]["spec"]["x-kubernetes-validations"][0]["rule"] = "has(self.a)"
    assert "False evaluating rule" in default_problems(node)[0]
    node["properties"]["spec"]["default"] = {"a": "x"}
    assert any("is not of type 'integer'" in p for p in default_problems(node))


def test_crd_is_a_valid_apiextensions_object(crd):
    kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)
    assert crd["spec"]["group"] == "slipstream.dev"
    assert crd["spec"]["names"]["shortNames"] == ["infsvc"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"


def test_kopf_peering_crds_are_valid():
    path = pathlib.Path(__file__).resolve().parents[2] / "crds" / "kopf-peering.yaml"
    docs = list(yaml.safe_load_all(path.read_text()))
    assert {d["spec"]["names"]["kind"] for d in docs} == {"ClusterKopfPeering", "KopfPeering"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_printer_columns_cover_the_operators_view(crd):
    columns = [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert columns == ["Ready", "Reason", "Replicas", "Desired", "Queue", "KV%", "URL", "Age"]


def test_schema_is_structural(crd_schema):
    """Every node says its type (or is int-or-string / preserves unknown fields), as a
    structural schema must, and nothing but status and valueFrom keeps unknown fields."""
    for path, node in walk_schema(crd_schema):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            assert path in (".spec.env[].valueFrom", ".status.autoscaler"), path


PROBES = (-1, 0, 0.05, 0.5, 1, 1.0, 1.5, 2, 7, 99.5, 1000, True, "5", [])
ENGINE_PROBES = [("engine", "gpuMemoryUtilization", v) for v in PROBES + (1e-9, None)] + [
    ("engine", "enforceEager", v) for v in (True, False, 0, 1, "true", None)] + [
    ("engine", "quantization", v) for v in ("auto", "none", "int4", 4, None)] + [
    ("engine", "maxWaiting", v) for v in (-1, 0, 1, 512, 1.5, True, "8", None)] + [
    ("engine", "longPrefillTokenThreshold", v) for v in (-1, 0, 1, 256, 1.5, True, "8", None)] + [
    ("engine", "kvCacheMemory", v) for v in ("512Mi", 2 ** 20, "lots", None)] + [
    ("resources", "gpus", v) for v in (-1, 0, 1, 2, 8, 1.5, True, "1")]


def api_accepts(crd_schema, obj) -> bool:
    """Whether the API server would admit ``obj``: schema bounds, then CEL rules after defaulting."""
    return not schema_errors(crd_schema, obj) and not cel_violations(crd_schema, schema_defaults(crd_schema, obj))


def parser_accepts(obj) -> bool:
    """Whether the operator's parser takes ``obj``'s spec."""
    try:
        parse_spec(obj["spec"], name="probe")
    except SpecError:
        return False
    return True


@pytest.mark.parametrize("block,key,value", ENGINE_PROBES, ids=str)
def test_the_api_server_and_the_parser_accept_the_same_engine_and_gpu_values(block, key, value,
                                                                             crd_schema):
    """The GPU settings of issue 14, value by value: schema bounds and CEL rules
    after defaulting, against parse_spec. (A null is pruned by the API server and skipped by
    the parser.) The pod's memory is large enough for any KV cache probed here."""
    raw = {block: {key: value}} if value is not None else {block: {}}
    raw.setdefault("resources", {}).setdefault("memory", "64Gi")
    obj = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "probe"}, "spec": raw}
    api, ours = api_accepts(crd_schema, obj), parser_accepts(obj)
    assert ours is api, f"{key}={value!r}: API server {api}, parser {ours}"


# spec.parallelism beside spec.resources.gpus: ranges, types, and gpus == tensor when both are
# set (gpus 0 is a CPU pod, whose ranks share its cores); None leaves the key out.
PARALLELISM_PROBES = [(tensor, pipeline, gpus)
                      for tensor in (None, -1, 0, 1, 2, 4, 8, 1.5, True, "2")
                      for pipeline in (None, 0, 1, 2)
                      for gpus in (None, 0, 1, 2, 4)]


@pytest.mark.parametrize("tensor,pipeline,gpus", PARALLELISM_PROBES, ids=str)
def test_the_api_server_and_the_parser_accept_the_same_parallelism(tensor, pipeline, gpus,
                                                                   crd_schema):
    """Issue 34's contract, value by value: schema bounds, the CEL rule on the spec's node
    (gpus must equal tensor when both are set) after defaulting, against parse_spec."""
    parallelism = {k: v for k, v in (("tensor", tensor), ("pipeline", pipeline)) if v is not None}
    resources = {"memory": "64Gi", **({"gpus": gpus} if gpus is not None else {})}
    obj = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "probe"},
           "spec": {"parallelism": parallelism, "resources": resources}}
    api, ours = api_accepts(crd_schema, obj), parser_accepts(obj)
    assert ours is api, f"{parallelism} gpus={gpus}: API server {api}, parser {ours}"


def test_gpus_alone_mean_tensor_and_tensor_alone_on_cpu_runs_ranks_on_cores():
    gpus = parse_spec({"resources": {"gpus": 4, "memory": "64Gi"}})
    cpu = parse_spec({"parallelism": {"tensor": 2}, "resources": {"memory": "8Gi"}})
    both = parse_spec({"parallelism": {"tensor": 4, "pipeline": 2}, "resources": {"gpus": 4}})
    assert (gpus.tensor_parallel_size, gpus.pipeline_parallel_size) == (4, 1)
    assert (cpu.tensor_parallel_size, cpu.resources.gpus) == (2, 0)
    assert (both.tensor_parallel_size, both.pipeline_parallel_size) == (4, 2)
    assert parse_spec({}).tensor_parallel_size == 1


ROUTING_PROBES = [("enabled", v) for v in (True, False, 1, "yes")] + [
    ("policy", v) for v in ("round-robin", "least-loaded", "prefix", "kv-events", "random", "")] + [
    (k, v) for k in ("queueSize", "queueTimeoutSeconds", "replicas")
    for v in (-1, 0, 1, 2, 1000, 1.5, True, "5")] + [
    ("weights", {k: v}) for k in ("prefix", "queue", "kvCache", "affinity")
    for v in (-1, -0.5, 0, 0.5, 3, True, "1")] + [
    ("weights", {"prefix": 0, "queue": 0, "kvCache": 0, "affinity": 0}),
    ("weights", {"prefix": 0, "queue": 0, "kvCache": 0, "affinity": 0.1}),
    ("weights", {"bias": 1}), ("weights", 3), ("extra", 1)]


@pytest.mark.parametrize("key,value", ROUTING_PROBES, ids=str)
def test_the_api_server_and_the_parser_accept_the_same_routing_values(key, value, crd_schema):
    """Schema bounds and CEL rules (after defaulting) against RoutingSpec's checks; an unknown
    key is pruned by the API server (structural schema) and refused by the parser, which only
    ever sees what the server kept."""
    obj = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "probe"}, "spec": {"routing": {key: value}}}
    api, ours = api_accepts(crd_schema, obj), parser_accepts(obj)
    unknown = key == "extra" or (key == "weights" and isinstance(value, dict) and "bias" in value)
    assert ours is (False if unknown else api), f"{key}={value!r}: API server {api}, parser {ours}"


MODEL_PROBES = [{"uri": u} for u in (
    "hf://Qwen/Qwen3-8B", "Qwen/Qwen3-8B", "hf://Qwen/Qwen3-8B@main", "hf://org/name@3f2a9c1:*Q4_K_M.gguf",
    "hf://org/name:model.gguf", "hf://org/name:a:b", "hf://org/name#x", "hf://org", "hf://org/", "hf:/org/name", "hf://org/na me", "hf://org/name@",
    "hf://org/name@a@b", "hf://-org/name", "hf://org--x/name", "hf://org/name/extra",
    "s3://models/llama/8b", "s3://models", "s3://Models/x", "s3://ab/x", "s3://m", "s3:/models/x",
    "pvc://weights/llama", "pvc://weights", "pvc://Weights/x", "pvc://weights/../etc", "pvc:///x",
    "oci://ghcr.io/org/model:1", "oci://127.0.0.1:5000/models/smollm2", "oci://ghcr.io/org/model@sha256:" + "a" * 64,
    "oci://ghcr.io/Org/model:1", "oci://ghcr.io", "oci://ghcr.io/org/model:", "http://example/model", "builtin", "sim:tiny", "sim:tiny,seed=3",
    "sim:Tiny", "sim:", "", "/models/x.gguf")] + [
    {"uri": "hf://org/name", "source": "builtin"}, {"uri": "hf://org/name", "source": "image"},
    {"uri": "hf://org/name", "path": "/x"}, {"uri": "pvc://c/x", "claimName": "c"},
    {"uri": "sim:tiny", "profile": "tiny"},
    {"uri": "hf://org/name", "secretRef": {"name": "hf-token"}}, {"uri": "hf://org/name", "secretRef": {}},
    {"uri": "hf://org/name", "secretRef": {"name": "Bad_Name"}},
    {"uri": "s3://models/x", "secretRef": {"name": "aws"}, "s3": {"endpoint": "http://127.0.0.1:9000", "region": "us-east-1"}},
    {"uri": "s3://models/x", "s3": {"endpoint": "ftp://x"}}, {"uri": "hf://org/name", "s3": {"region": "eu"}},
    {"uri": "hf://org/name", "cache": {"claimName": "model-cache", "maxSize": "100Gi"}},
    {"uri": "hf://org/name", "cache": {"claimName": "model-cache", "hostPath": "/var/cache/m"}},
    {"uri": "hf://org/name", "cache": {"hostPath": "var/cache"}}, {"uri": "hf://org/name", "cache": {"claimName": "Cache"}}, {"uri": "hf://org/name", "cache": {"maxSize": "lots"}},
    {"uri": "hf://org/name", "cache": {"maxSize": 1000000}}, {"uri": "hf://org/name", "cache": {"maxSize": "0"}},
    {"uri": "pvc://c/x", "cache": {"claimName": "model-cache"}}, {"uri": "pvc://c/x", "cache": {}},
    {"uri": "hf://org/name", "s3": {}}, {"uri": "hf://org/name", "oci": {}},
    {"uri": "oci://ghcr.io/org/model:1", "oci": {"mount": "modelcar"}},
    {"uri": "oci://ghcr.io/org/model:1", "oci": {"mount": "image-volume"}},
    {"uri": "oci://ghcr.io/org/model:1", "oci": {"mount": "sidecar"}},
    {"uri": "oci://ghcr.io/org/model:1", "cache": {"claimName": "c"}}, {"uri": "oci://ghcr.io/org/model:1", "secretRef": {"name": "s"}}, {"uri": "builtin", "secretRef": {"name": "x"}},
    {"source": "image", "path": "/m", "cache": {"claimName": "c"}}, {"source": "pvc", "path": "m", "claimName": "c"},
    {"source": "builtin"}, {}, {"path": "/x"}, {"claimName": "c"}, {"profile": "tiny"}]


@pytest.mark.parametrize("model", MODEL_PROBES, ids=str)
def test_the_api_server_and_the_parser_accept_the_same_models(model, crd_schema):
    """spec.model's uri forms and download fields: schema patterns and CEL rules (after
    defaulting) against model_spec.validate_model, probe by probe."""
    obj = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "probe"}, "spec": {"model": model}}
    api, ours = api_accepts(crd_schema, obj), parser_accepts(obj)
    assert ours is api, f"{model}: API server {api}, parser {ours}"


@pytest.mark.parametrize("key", list(CRD_KEYS))
def test_the_api_server_and_the_parser_accept_the_same_autoscaling_values(key, crd_schema):
    """Schema bounds and CEL rules (after defaulting, as the API server runs them) against
    AutoscalingSpec's checks, value by value, including the bounds themselves."""
    disagree = []
    for value in PROBES:
        obj = {"apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
               "metadata": {"name": "probe"}, "spec": {"autoscaling": {key: value}}}
        api = not schema_errors(crd_schema, obj) and not cel_violations(crd_schema, schema_defaults(crd_schema, obj))
        try:
            parse_spec(obj["spec"], name="probe")
            ours = True
        except SpecError:
            ours = False
        if api != ours:
            disagree.append(f"{key}={value!r}: API server {'accepts' if api else 'refuses'}, parser "
                            f"{'accepts' if ours else 'refuses'}")
    assert disagree == []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_schema_cel_and_operator(path, crd_schema):
    obj = yaml.safe_load(path.read_text())
    assert schema_errors(crd_schema, obj) == []
    defaulted = schema_defaults(crd_schema, obj)
    assert cel_violations(crd_schema, defaulted) == []
    assert parse_spec(obj["spec"], name=obj["metadata"]["name"]) == \
        parse_spec(defaulted["spec"], name=obj["metadata"]["name"])
    obj["metadata"].setdefault("namespace", "default")
    spec = parse_spec(obj["spec"], name=obj["metadata"]["name"])
    workload = "LeaderWorkerSet" if spec.pipeline_parallel_size > 1 else "Deployment"
    assert [c["kind"] for c in render_children(obj)][:2] == [workload, "Service"]


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_files_are_rejected_by_their_layer_and_by_the_operator(path, crd_schema):
    obj = yaml.safe_load(path.read_text())
    layer, needle = header(path, "rejected by"), header(path, "message mentions")
    errors = schema_errors(crd_schema, obj)
    if layer == "schema":
        assert errors, "the schema should reject it"
    else:
        assert errors == []
        violations = cel_violations(crd_schema, schema_defaults(crd_schema, obj))
        if layer == "cel":
            assert violations and any(needle in m for m in violations), violations
        else:
            assert violations == []
    with pytest.raises(SpecError) as caught:
        parse_spec(obj["spec"], name=obj["metadata"]["name"])
    assert needle in caught.value.message
