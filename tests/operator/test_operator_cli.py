"""``slipstream operator`` command line, the REST client's credentials, and leader election."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import aiohttp
import kopf
import kubernetes.config.kube_config
import pytest
import yaml

from operator_helpers import EXAMPLES, ROOT, eventually, running_operator
from slipstream.operator.cli import build_parser, main, operator_arguments
from slipstream.operator.handlers import ensure_peering
from slipstream.operator.kube import CLUSTER_PEERINGS, DEPLOYMENTS, INFERENCESERVICES, PEERINGS, \
    ApiError, Kube
from slipstream.operator.resources import needs_disruption_budget
from slipstream.operator.spec import parse_spec

BUILTIN = ROOT / "examples" / "inferenceservice-builtin.yaml"


RENDERED_BUILTIN = ["Deployment", "Service", "Service", "ServiceAccount", "Role", "RoleBinding",
                    "Deployment"]


def test_render_prints_deployment_services_and_gateway(capsys):
    assert main(["render", "-f", str(BUILTIN)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs] == \
        [("Deployment", "smollm2", "default"), ("Service", "smollm2", "default"),
         ("Service", "smollm2-pods", "default"), ("ServiceAccount", "smollm2-gateway", "default"),
         ("Role", "smollm2-gateway", "default"), ("RoleBinding", "smollm2-gateway", "default"),
         ("Deployment", "smollm2-gateway", "default")]


def test_render_takes_many_documents_and_skips_other_kinds(tmp_path, capsys):
    text = "\n---\n".join(path.read_text() for path in EXAMPLES)
    text += "\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n"
    path = tmp_path / "all.yaml"
    path.write_text(text)
    assert main(["render", "-f", str(path), "-n", "team"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    # Deployment + two Services each, a PodDisruptionBudget for those that can run several
    # pods, and four gateway objects for those with routing on.
    specs = [parse_spec(yaml.safe_load(p.read_text())["spec"]) for p in EXAMPLES]
    budgets = sum(needs_disruption_budget(spec) for spec in specs)
    routed = sum(spec.routing.enabled for spec in specs)
    assert budgets >= 2 and routed >= 1
    assert len(docs) == 3 * len(EXAMPLES) + budgets + 4 * routed
    assert {d["metadata"]["namespace"] for d in docs} == {"team"}


def test_render_explains_an_invalid_spec(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(textwrap.dedent("""
        apiVersion: slipstream.dev/v1alpha1
        kind: InferenceService
        metadata: {name: bad}
        spec:
          autoscaling: {minReplicas: 3, maxReplicas: 1}
    """))
    assert main(["render", "-f", str(path)]) == 1
    err = capsys.readouterr().err
    assert "InferenceService bad" in err and "minReplicas (3) must be ≤ maxReplicas (1)" in err
    assert main(["render", "-f", str(tmp_path / "missing.yaml")]) == 1


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "slipstream.operator"],
    [sys.executable, "-c", "import sys; from slipstream.server.cli import main; sys.exit(main())",
     "operator"],  # what the `slipstream` script runs
], ids=["python-m", "slipstream"])
def test_render_from_the_command_line(command):
    done = subprocess.run(command + ["render", "-f", str(BUILTIN)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [d["kind"] for d in yaml.safe_load_all(done.stdout)] == RENDERED_BUILTIN


def test_run_arguments():
    parser = build_parser()
    args = parser.parse_args(["run", "--namespace", "a", "-n", "b", "--liveness",
                              "http://0.0.0.0:8080/healthz", "--peering", "p"])
    assert (args.namespaces, args.all_namespaces, args.liveness, args.peering) == \
        (["a", "b"], False, "http://0.0.0.0:8080/healthz", "p")
    args = parser.parse_args(["--all-namespaces", "--standalone"])
    assert args.command is None and args.all_namespaces and args.standalone
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "-A", "-n", "a"])
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--standalone", "--peering", "p"])


@pytest.mark.parametrize("flags, message", [
    (["--lease-seconds", "0"], "--lease-seconds: must be >= 1"),
    (["--peering-lifetime", "-1"], "--peering-lifetime: must be >= 1"),
    (["--resync-seconds", "0"], "--resync-seconds: must be > 0"),
    (["--lease-namespace", "BAD_NS!"], "RFC 1123 label"),
    (["--lease-namespace", ""], "RFC 1123 label"),
])
def test_run_refuses_durations_and_names_that_cannot_work(flags, message, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "-n", "a", *flags])
    assert message in capsys.readouterr().err


def use_kubeconfig(api, tmp_path, monkeypatch) -> None:
    """Point the kubernetes client (and so kopf and Kube.from_environment) at ``api``."""
    config = tmp_path / "kubeconfig"
    config.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": str(api.url).rstrip("/")}}],
        "users": [{"name": "test", "user": {"token": "secret-token"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
    # The client library reads $KUBECONFIG once, at import; set what it read.
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION",
                        str(config))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)


async def test_client_finds_credentials_in_kubeconfig(api, tmp_path, monkeypatch):
    use_kubeconfig(api, tmp_path, monkeypatch)
    kube = Kube.from_environment()
    try:
        assert await kube.get(INFERENCESERVICES, "ml", "nothing") is None
        assert list(api)[-1].headers["Authorization"] == "Bearer secret-token"
        with pytest.raises(ApiError) as caught:
            await kube.request("GET", "/apis/nowhere.dev/v1/namespaces/ml/things")
        assert caught.value.status == 404 and not caught.value.retryable
    finally:
        await kube.close()


async def test_peering_objects_are_created_once(api, kube):
    for doc in yaml.safe_load_all((ROOT / "crds" / "kopf-peering.yaml").read_text()):
        api.add_crd(doc)
    await ensure_peering(kube, "slipstream-operator", None, _Quiet())
    await ensure_peering(kube, "slipstream-operator", None, _Quiet())  # already there: no-op
    await ensure_peering(kube, "slipstream-operator", ("ml", "team-*"), _Quiet())
    assert await kube.get(CLUSTER_PEERINGS, None, "slipstream-operator") is not None
    assert await kube.get(PEERINGS, "ml", "slipstream-operator") is not None
    assert await kube.list(PEERINGS, "team-x") == []  # globs are not created


async def test_missing_peering_crds_are_named(kube):
    with pytest.raises(kopf.PermanentError, match="kopf-peering.yaml"):
        await ensure_peering(kube, "slipstream-operator", None, _Quiet())


class _Quiet:
    def info(self, *_: object) -> None:
        pass


@pytest.mark.timeout(60)
@pytest.mark.slow
async def test_operator_command_serves_its_namespace_with_peering_and_liveness(
        api, kube, tmp_path, monkeypatch):
    for doc in yaml.safe_load_all((ROOT / "crds" / "kopf-peering.yaml").read_text()):
        api.add_crd(doc)
    use_kubeconfig(api, tmp_path, monkeypatch)
    api.namespaces |= {"ml", "elsewhere"}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = build_parser().parse_args(["run", "--namespace", "ml", "--liveness",
                                      f"http://127.0.0.1:{port}/healthz"])
    body = yaml.safe_load(BUILTIN.read_text())
    async with running_operator(**operator_arguments(args)):
        for namespace in ("ml", "elsewhere"):
            await kube.create(INFERENCESERVICES, {**body, "metadata": {
                "name": "smollm2", "namespace": namespace}})
        await eventually(lambda: kube.get(DEPLOYMENTS, "ml", "smollm2"), what="Deployment")
        peering = await eventually(lambda: _with_status(kube.get(PEERINGS, "ml",
                                                                 "slipstream-operator")),
                                   what="a keep-alive in the peering object")
        assert len(peering["status"]) == 1  # this operator, alone: it acts
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as answer:
                assert answer.status == 200
        assert await kube.get(DEPLOYMENTS, "elsewhere", "smollm2") is None


async def _with_status(get):
    obj = await get
    return obj if obj and obj.get("status") else None
