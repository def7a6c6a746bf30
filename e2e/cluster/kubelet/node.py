"""The Node object and its heartbeats: registration, the NodeReady condition, and the Lease in
``kube-node-lease`` renewed every RENEW_S (the node lifecycle controller marks a node whose
Lease is older than its grace period, 40-50 s, NotReady, taints it and evicts its pods).
"""
from __future__ import annotations

import datetime as dt
import logging
import platform
import threading

from kubernetes import client
from kubernetes.client.rest import ApiException

from .objects import raw
from .status import rfc3339

log = logging.getLogger("kubelet.node")
RENEW_S = 10.0
STATUS_S = 60.0
LEASE_S = 40
KUBELET_VERSION = "v1.36.3"


def node_manifest(name: str, gpus: int, address: str, pod_cidr: str) -> dict:
    """The Node as this kubelet registers it (labels, capacity, address, version info)."""
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    if gpus:
        capacity["nvidia.com/gpu"] = str(gpus)
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64", "beta.kubernetes.io/os": "linux",
            "beta.kubernetes.io/arch": "amd64"}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {
            "capacity": capacity, "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": KUBELET_VERSION,
                         "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "process://0.1.0", "kernelVersion": platform.release(),
                         "osImage": "slipstream process kubelet", "machineID": "", "systemUUID": "",
                         "bootID": ""},
            "conditions": node_conditions(rfc3339()),
        },
    }


def node_conditions(since: str) -> list[dict]:
    now = rfc3339()
    rows = [("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status")]
    return [{"type": t, "status": s, "reason": r, "message": m, "lastHeartbeatTime": now,
             "lastTransitionTime": since} for t, s, r, m in rows]


def micro_time() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class NodeAgent:
    """Registers the Node and keeps it Ready (status every STATUS_S, Lease every RENEW_S)."""

    def __init__(self, api: client.ApiClient, manifest: dict):
        self.core = client.CoreV1Api(api)
        self.leases = client.CoordinationV1Api(api)
        self.manifest = manifest
        self.name = manifest["metadata"]["name"]
        self.stop = threading.Event()
        self.uid = ""
        self.since = rfc3339()

    def register(self) -> None:
        existing = raw(self.core.read_node, self.name)
        if existing is None:
            existing = raw(self.core.create_node, self.manifest)
            log.info("node %s registered", self.name)
        else:
            self.core.patch_node(self.name, {"metadata": {"labels": self.manifest["metadata"]["labels"]},
                                             "spec": {"unschedulable": False}}, _preload_content=False)
            log.info("node %s exists; taking it over", self.name)
        self.uid = existing["metadata"]["uid"]
        self.post_status()
        self.renew_lease()

    def post_status(self) -> None:
        status = {**self.manifest["status"], "conditions": node_conditions(self.since)}
        self.core.patch_node_status(self.name, {"status": status}, _preload_content=False)

    def renew_lease(self) -> None:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease",
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name,
                                                  "uid": self.uid}]},
                "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_S, "renewTime": micro_time()}}
        try:
            self.leases.patch_namespaced_lease(self.name, "kube-node-lease", {"spec": body["spec"]},
                                               _preload_content=False)
        except ApiException as err:
            if err.status != 404:
                raise
            self.leases.create_namespaced_lease("kube-node-lease", body, _preload_content=False)

    def start(self) -> None:
        threading.Thread(target=self._beat, name="node-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        ticks = 0
        while not self.stop.wait(RENEW_S):
            ticks += 1
            try:
                self.renew_lease()
                if ticks % int(STATUS_S / RENEW_S) == 0:
                    self.post_status()
            except Exception as err:  # noqa: BLE001 - the API server may be restarting
                log.warning("node heartbeat failed: %s", err)
