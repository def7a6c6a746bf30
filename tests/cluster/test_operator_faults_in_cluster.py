"""The operator's own faults (issue 33) on the real control plane, with the operator run as
local processes (``slipstream operator run``, the admin kubeconfig) so that a test can stop
one and start two: exactly one writer after a partition (the write fence, operator/lease.py),
and a spec fixed during an error backoff acted on at once (handlers.reconcile_on_change).
The chart's in-cluster operator is not installed in this module (every module uninstalls it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from cluster_helpers import CHART, REPO, condition, get, now, wait_for

pytestmark = pytest.mark.timeout(300)

NAMESPACE = "faults"
LEASE_SECONDS, RENEW_SECONDS = 6, 2  # --lease-seconds; the fence renews a third of it
PEERING_LIFETIME = 8


def service(name: str, autoscaling: dict | None = None, memory: str = "1Gi") -> dict:
    return {
        "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"source": "sim", "profile": "tiny"}, "replicas": 1,
                 "autoscaling": autoscaling or {"enabled": False},
                 "routing": {"enabled": False},
                 "resources": {"cpu": "250m", "memory": memory}},
    }


class LocalOperator:
    """One ``slipstream operator run`` process serving NAMESPACE with peering; its log in
    ``log``; ``identity`` names it in the Lease and in the User-Agent of its requests."""

    def __init__(self, cluster, identity: str, priority: int, log_dir: Path):
        self.identity = identity
        self.log = log_dir / f"{identity}.log"
        env = {**cluster.env(), "POD_NAME": identity, "POD_ID": identity}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.operator", "run", "-n", NAMESPACE,
             "--peering", "faults", "--priority", str(priority),
             "--lease-seconds", str(LEASE_SECONDS), "--peering-lifetime", str(PEERING_LIFETIME)],
            cwd=REPO, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def operators(cluster, tmp_path):
    """Starts local operators on demand (``operators(identity, priority)``); the CRDs applied
    and NAMESPACE made first; the operators stopped and the test's objects removed afterwards
    (NAMESPACE stays: a terminating namespace would refuse the next test's objects)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds"))
    cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    started: list[LocalOperator] = []

    def start(identity: str, priority: int) -> LocalOperator:
        started.append(LocalOperator(cluster, identity, priority, tmp_path))
        return started[-1]

    yield start
    cluster.kubectl("delete", "infsvc", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=60s",
                    check=False)
    for op in started:
        op.stop()
    cluster.kubectl("delete", "validatingwebhookconfiguration", "faults-down", check=False)
    for op in started:  # for a failure's report
        print(f"--- {op.identity}\n{op.log.read_text(errors='replace')[-3000:]}")


def apply(cluster, obj: dict) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def audited(cluster, since: datetime):
    """The audit log's completed requests received after ``since``."""
    for line in cluster.plane.audit_log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("stage") != "ResponseComplete":
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if received >= since:
            yield received, event


def deployment_writes(cluster, name: str, since: datetime) -> list[tuple[float, str]]:
    """(epoch seconds, operator identity) of every successful write of Deployment ``name``
    by a local operator (its User-Agent is ``slipstream-operator/IDENTITY``)."""
    out = []
    for received, e in audited(cluster, since):
        ref, agent = e.get("objectRef") or {}, e.get("userAgent") or ""
        if (ref.get("resource") == "deployments" and ref.get("name") == name
                and e.get("verb") in ("patch", "update") and agent.startswith("slipstream-operator/")
                and (e.get("responseStatus") or {}).get("code") == 200):
            out.append((received.timestamp(), agent.split("/", 1)[1]))
    return sorted(out)


def test_after_a_partition_only_one_operator_replica_writes_the_deployment(operators, cluster):
    """Two replicas with peering; the acting one (op-a) is stopped (SIGSTOP: cut off, its
    timers frozen) past its peering lifetime and its Lease, so op-b takes over, then
    continued. Meanwhile `kubectl scale` sets the Deployment to 2 every second and the acting
    replica sets it back to 1. Unfenced, op-a's due ticks write at once on SIGCONT while op-b
    still acts; fenced, a replica writes only after the other's Lease lapsed: between two
    writes by different replicas lie at least LEASE_SECONDS - RENEW_SECONDS."""
    started = now()
    a = operators("op-a", 2)
    operators("op-b", 1)
    apply(cluster, service("part", {"enabled": True, "policy": "queue", "minReplicas": 1,
                                    "maxReplicas": 2}))
    wait_for(lambda: condition(get(cluster, "infsvc", "part", "-n", NAMESPACE), "ScalingActive"),
             90, "the autoscaler's first tick")
    done = threading.Event()

    def hand_scale() -> None:
        while not done.is_set():
            cluster.kubectl("scale", "deploy", "part", "-n", NAMESPACE, "--replicas", "2",
                            check=False)
            time.sleep(1)

    scaler = threading.Thread(target=hand_scale, daemon=True)
    scaler.start()
    try:
        wait_for(lambda: any(w == "op-a" for _, w in deployment_writes(cluster, "part", started)),
                 30, "op-a setting the replicas back")
        a.signal(signal.SIGSTOP)
        stopped = time.time()
        wait_for(lambda: any(w == "op-b" for _, w in deployment_writes(cluster, "part", started)),
                 PEERING_LIFETIME + LEASE_SECONDS + 20, "op-b taking over")
        time.sleep(2)
        a.signal(signal.SIGCONT)
        resumed = time.time()
        wait_for(lambda: any(w == "op-a" and t > resumed
                             for t, w in deployment_writes(cluster, "part", started)),
                 PEERING_LIFETIME + LEASE_SECONDS + 20, "op-a, the higher priority, acting again")
        time.sleep(4)
    finally:
        done.set()
        scaler.join()
    writes = deployment_writes(cluster, "part", started)
    report = [(round(t - stopped, 1), w) for t, w in writes]
    print(f"writes (seconds after SIGSTOP, resumed at {resumed - stopped:.1f}): {report}")
    handovers = [(t1, w1, t2, w2) for (t1, w1), (t2, w2) in zip(writes, writes[1:]) if w1 != w2]
    assert [(w1, w2) for _, w1, _, w2 in handovers] == [("op-a", "op-b"), ("op-b", "op-a")], report
    for t1, _, t2, _ in handovers:
        assert t2 - t1 >= LEASE_SECONDS - RENEW_SECONDS - 0.5, report
    lease = get(cluster, "lease", "faults", "-n", NAMESPACE)
    assert lease["spec"]["holderIdentity"] == "op-a" and lease["spec"]["leaseTransitions"] >= 2


def test_a_spec_fixed_during_the_error_backoff_is_acted_on_at_once(operators, cluster):
    """An admission webhook that is down (failurePolicy Fail: the API server answers 500)
    refuses Deployments with the memory 1111Mi, so the reconcile fails and is retried with a
    growing backoff (1, 2, 4, 8, 16 s...). After five failures the spec is fixed: the
    Deployment is made within a few seconds, not after the next backoff step."""
    started = now()
    operators("op-solo", 1)
    apply(cluster, {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "faults-down"},
        "webhooks": [{
            "name": "down.faults.slipstream.dev", "admissionReviewVersions": ["v1"],
            "sideEffects": "None", "failurePolicy": "Fail", "timeoutSeconds": 2,
            "clientConfig": {"url": "https://127.0.0.1:9/validate"},  # nothing listens there
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
            "rules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"],
                       "operations": ["CREATE", "UPDATE"]}],
            "matchConditions": [{"name": "memory-1111Mi", "expression":
                                 "object.spec.template.spec.containers.exists(c, "
                                 "has(c.resources) && has(c.resources.requests) && "
                                 "'memory' in c.resources.requests && "
                                 "c.resources.requests['memory'] == '1111Mi')"}]}]})

    def failures() -> int:
        return sum(1 for _, e in audited(cluster, started)
                   if (e.get("objectRef") or {}).get("resource") == "deployments"
                   and e.get("verb") == "create"
                   and (e.get("userAgent") or "").startswith("slipstream-operator/")
                   and (e.get("responseStatus") or {}).get("code", 0) >= 500)

    apply(cluster, service("backoff", memory="1111Mi"))
    wait_for(lambda: failures() >= 5, 60, "five refused creates of the Deployment")
    time.sleep(1)
    assert get(cluster, "deploy", "backoff", "-n", NAMESPACE) is None
    fixed = time.monotonic()
    apply(cluster, service("backoff", memory="1Gi"))
    wait_for(lambda: get(cluster, "deploy", "backoff", "-n", NAMESPACE), 20, "the Deployment",
             interval=0.2)
    took = time.monotonic() - fixed
    print(f"Deployment made {took:.1f} s after the fix ({failures()} refused creates before)")
    assert took < 5, took  # kopf's next retry was 16 s away
