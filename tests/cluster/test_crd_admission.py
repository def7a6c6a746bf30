"""The CRD on the real API server: `kubectl apply -f crds/` is accepted, the examples pass
server-side validation, and every file in tests/operator/invalid/ is refused by the layer its
header names, with the message it documents (the API server runs the OpenAPI schema and the CEL
rules; files the operator alone can judge are accepted here and refused by it, see
test_operator_in_cluster.py)."""
from __future__ import annotations


import pytest
import yaml

from invalid_specs import INVALID, header
from cluster_helpers import EXAMPLES, REPO, get




@pytest.fixture(scope="module")
def crd_applied(cluster):
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                    "crd/inferenceservices.slipstream.dev")
    return cluster


def test_the_crd_is_accepted_and_established(crd_applied):
    crd = get(crd_applied, "crd", "inferenceservices.slipstream.dev")
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    assert conditions.get("NonStructuralSchema", "False") == "False"


def test_the_chart_ships_the_same_crds(crd_applied):
    for path in (REPO / "crds").glob("*.yaml"):
        assert path.read_text() == (REPO / "charts" / "slipstream" / "crds" / path.name).read_text()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_example_passes_server_side_validation(crd_applied, path):
    doc = yaml.safe_load(path.read_text())
    namespace = doc["metadata"].get("namespace", "default")
    crd_applied.kubectl("create", "namespace", namespace, check=False)
    proc = crd_applied.kubectl("create", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_files_are_refused_by_the_api_server_with_their_message(crd_applied, path):
    layer, needle = header(path, "rejected by"), header(path, "message mentions")
    proc = crd_applied.kubectl("create", "--dry-run=server", "-f", str(path), check=False)
    if layer == "operator":
        assert proc.returncode == 0, f"only the operator can tell, yet the server said: {proc.stderr}"
        return
    assert proc.returncode != 0, f"the API server accepted {path.name}"
    assert "is invalid" in proc.stderr, proc.stderr
    assert needle in proc.stderr, proc.stderr


def test_a_misspelt_field_is_refused_by_strict_field_validation(crd_applied):
    doc = yaml.safe_load((EXAMPLES / "inferenceservice-builtin.yaml").read_text())
    doc["spec"]["replica"] = doc["spec"].pop("replicas")
    proc = crd_applied.kubectl("create", "--dry-run=server", "-f", "-",
                               input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0
    assert 'unknown field "spec.replica"' in proc.stderr, proc.stderr
