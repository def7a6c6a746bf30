"""The InferenceService CRD is generated from the contract's models (``make crds``); the
checked-in files are what the generator writes today, byte for byte."""
from __future__ import annotations

from pathlib import Path

import yaml

from slipstream.api_types import crd
from slipstream.api_types.inference_service import InferenceServiceSpec

ROOT = Path(__file__).resolve().parents[2]


def test_the_checked_in_crds_are_the_generated_ones(tmp_path):
    assert crd.main([str(tmp_path)]) == 0
    for name in crd.OUTPUTS:
        assert (tmp_path / name).read_bytes() == (ROOT / name).read_bytes(), \
            f"{name} is not what the models generate: run make crds and commit the result"


def test_generating_twice_gives_the_same_bytes(tmp_path):
    crd.main([str(tmp_path / "a")])
    crd.main([str(tmp_path / "b")])
    for name in crd.OUTPUTS:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_the_yaml_reads_back_as_the_crd_object():
    """The generator's own YAML writer (the contract depends on pydantic alone) against PyYAML."""
    assert yaml.safe_load(crd.render()) == crd.crd()


def test_the_schemas_defaults_are_the_models_defaults():
    """Filling every default the CRD declares gives the spec the models give for ``{}``."""
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def fill(node: dict, value: dict) -> dict:
        for key, sub in node.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = sub["default"]
            if isinstance(value.get(key), dict) and sub.get("type") == "object":
                fill(sub, value[key])
        return value

    assert InferenceServiceSpec.from_dict(fill(schema, {})) == InferenceServiceSpec()


def test_every_schema_node_has_a_type_and_no_reference():
    """A structural schema: a type on every node (or int-or-string), no $ref, no nullable anyOf."""
    def walk(node: dict, path: str):
        assert "$ref" not in node and "nullable" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        if "anyOf" in node:
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    walk(crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")


def test_the_contract_imports_pydantic_and_the_standard_library_only():
    """api_types is imported by the operator, the gateway, the engine and the simulator; it
    imports none of them (nor kubernetes, nor yaml)."""
    import ast
    import sys

    folder = ROOT / "src" / "slipstream" / "api_types"
    imported = set()
    for path in folder.glob("*.py"):
        # module level only: metrics.parse_exposition imports prometheus_client when called
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"pydantic"}
