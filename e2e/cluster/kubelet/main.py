"""The process kubelet: registers a Node, watches the pods bound to it and runs each in a
PodWorker; on SIGTERM stops its pods and removes its network.

    .venv/bin/python e2e/cluster/kubelet.py --kubeconfig build/cluster/kubeconfig --node-name node-1 \\
        [--gpus N] [--state-dir build/cluster/kubelet] [--pod-cidr 10.244.0.0/24] [--bridge slip0] \\
        [--apiserver-relay-port 6443] [--backoff-base 10] [--backoff-max 300] [--shutdown-grace 10]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import stat
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch import Watch

from .container import kill_leftovers
from .events import EventRecorder
from .images import SLIPSTREAM_UID
from .names import HeadlessRecords
from .network import PodNetwork, Relay
from .node import NodeAgent, node_manifest
from .objects import Objects
from .worker import PodWorker

log = logging.getLogger("kubelet")
REPO = Path(__file__).resolve().parents[3]
RELIST_S = 300.0


def exposed_dirs(targets: list[Path]) -> list[dict]:
    """The directories on the way to ``targets`` that others cannot traverse (e.g. /root, 0700,
    holding pyenv's Python), each with the paths under it that non-root containers must reach:
    the launcher covers each with a tmpfs showing only those (the launcher's ``expose``)."""
    keep: dict[Path, set[str]] = {}
    for target in targets:
        route = [*reversed(target.parents), target]
        for parent, child in zip(route, route[1:]):
            if not parent.stat().st_mode & stat.S_IXOTH:
                keep.setdefault(parent, set()).add(str(child))
    return [{"dir": str(d), "keep": sorted(k)} for d, k in sorted(keep.items())]


def check_readable(target: Path) -> None:
    """Exits naming ``target`` when others (the images' uid 10001) cannot read it."""
    mode = target.stat().st_mode
    if not mode & stat.S_IROTH:
        sys.exit(f"kubelet: {target} (mode {stat.filemode(mode)}) is not readable by others, so containers "
                 f"running as uid {SLIPSTREAM_UID} cannot use it: chmod -R o+rX {target}")


class Kubelet:
    def __init__(self, args: argparse.Namespace):
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(args.kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = 32  # pod workers write concurrently
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.objects = Objects(self.api)
        self.node_name = args.node_name
        self.events = EventRecorder(self.api, self.node_name)
        self.network = PodNetwork(args.bridge, args.pod_cidr)
        self.host_ip = self.network.gateway
        self.relay_port = args.apiserver_relay_port
        self.state_dir = args.state_dir.resolve()
        self.repo = REPO
        self.backoff_base, self.backoff_max = args.backoff_base, args.backoff_max
        self.shutdown_grace = args.shutdown_grace
        self.ca_pem = Path(self.api.configuration.ssl_ca_cert).read_bytes() if self.api.configuration.ssl_ca_cert else b""
        server = urlparse(self.api.configuration.host)
        self.apiserver = (server.hostname, server.port or 443)
        self.node = NodeAgent(self.api, node_manifest(self.node_name, args.gpus, self.host_ip, args.pod_cidr))
        self.workers: dict[str, PodWorker] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.names = HeadlessRecords(self.api, self._names_changed, self.stopping)

    def _names_changed(self, records: dict[str, str]) -> None:
        """Headless Services' pods changed: every pod's /etc/hosts is rewritten."""
        log.info("cluster DNS records: %s", records)
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.write_hosts()

    def service_env(self) -> dict[str, str]:
        """The variables of the ``kubernetes`` Service, pointing at this node's relay."""
        host, port = self.host_ip, str(self.relay_port)
        return {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port,
                "KUBERNETES_SERVICE_PORT_HTTPS": port, "KUBERNETES_PORT": f"tcp://{host}:{port}",
                f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
                f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp", f"KUBERNETES_PORT_{port}_TCP_PORT": port,
                f"KUBERNETES_PORT_{port}_TCP_ADDR": host}

    # ---- start and stop ---------------------------------------------------------------------
    def start(self) -> None:
        """Claims the pod network (RuntimeError when another kubelet has it), removes what an
        earlier run left, sets up the network and the API relay and registers the Node."""
        self.network.claim()
        python = (self.repo / ".venv" / "bin" / "python").resolve()
        for target in (python, self.repo / "pyproject.toml", self.repo / ".venv" / "pyvenv.cfg"):
            check_readable(target)
        self.image_paths = [Path(sys.base_prefix).resolve(), self.repo]  # what a mountPath must not hide
        self.exposed = exposed_dirs(self.image_paths)
        if self.exposed:
            log.info("non-root containers see only %s of %s", [e["keep"] for e in self.exposed],
                     [e["dir"] for e in self.exposed])
        pods_dir = self.state_dir / "pods"
        killed = kill_leftovers(pods_dir) if pods_dir.exists() else 0
        if killed:
            log.info("killed %d container(s) left by an earlier run", killed)
        self._remove_stale_dirs(pods_dir)
        self.network.setup()
        self.relay = Relay((self.host_ip, self.relay_port), self.apiserver)
        self.relay.start()
        log.info("pod network %s on bridge %s; API relay %s:%s -> %s:%s", self.network.net,
                 self.network.bridge, self.host_ip, self.relay_port, *self.apiserver)
        self.node.register()
        self.node.start()

    def _remove_stale_dirs(self, pods_dir: Path) -> None:
        for line in Path("/proc/mounts").read_text().splitlines():
            mount_point = line.split()[1]
            if mount_point.startswith(str(pods_dir) + "/"):
                os.system(f"umount -l '{mount_point}'")
        shutil.rmtree(pods_dir, ignore_errors=True)
        pods_dir.mkdir(parents=True)

    def shutdown(self) -> None:
        """Stops every pod (SIGTERM, then SIGKILL after --shutdown-grace) and the network."""
        log.info("shutting down: stopping %d pod(s)", len(self.workers))
        self.stopping.set()
        self.node.stop.set()
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop_for_shutdown()
        for w in workers:
            w.join(self.shutdown_grace + 5)
        self.events.flush()
        self.relay.stop()
        self.network.cleanup()

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)

    # ---- pods -------------------------------------------------------------------------------
    def sync(self, pod: dict) -> None:
        """Hands ``pod`` to its worker, starting one for a pod this kubelet should run."""
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if worker is not None:
                worker.update(pod)
                return
            if self.stopping.is_set() or pod["spec"].get("nodeName") != self.node_name:
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._finish_deletion(pod)  # nothing of it runs here (an earlier run's pod)
                return
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            worker = PodWorker(self, pod)
            self.workers[uid] = worker
        worker.start()

    def _finish_deletion(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], _preload_content=False,
                                            body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("pod %s/%s not deleted: %s", meta["namespace"], meta["name"], err.reason)

    def removed(self, uid: str) -> None:
        with self.lock:
            worker = self.workers.get(uid)
        if worker is not None:
            worker.removed()

    def watch_pods(self) -> None:
        """List, then watch, the pods bound to this node (relisting every RELIST_S and after
        any error), until stopped."""
        selector = f"spec.nodeName={self.node_name}"
        while not self.stopping.is_set():
            try:
                listed = json.loads(self.core.list_pod_for_all_namespaces(
                    field_selector=selector, _preload_content=False).data)
                present = {p["metadata"]["uid"] for p in listed["items"]}
                for pod in listed["items"]:
                    self.sync(pod)
                with self.lock:
                    known = set(self.workers)
                for uid in known - present:
                    self.removed(uid)
                self._watch(selector, listed["metadata"]["resourceVersion"])
            except Exception as err:  # noqa: BLE001 - the API server may be restarting
                if not self.stopping.is_set():
                    log.warning("pod watch: %s; relisting", err)
                    self.stopping.wait(1.0)

    def _watch(self, selector: str, rv: str) -> None:
        relist_at = time.monotonic() + RELIST_S
        while not self.stopping.is_set() and time.monotonic() < relist_at:
            watcher = Watch()
            for event in watcher.stream(self.core.list_pod_for_all_namespaces, field_selector=selector,
                                        resource_version=rv, timeout_seconds=60, allow_watch_bookmarks=True,
                                        _request_timeout=90, deserialize=False):
                obj = event["object"]  # plain JSON: no model objects to build
                if event["type"] == "ERROR":
                    return  # 410 Gone and friends: relist
                rv = obj["metadata"]["resourceVersion"]
                if event["type"] == "DELETED":
                    self.removed(obj["metadata"]["uid"])
                elif event["type"] in ("ADDED", "MODIFIED"):
                    self.sync(obj)
                if self.stopping.is_set():
                    watcher.stop()
                    return


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kubelet.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--node-name", default="node-1")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity of the node")
    p.add_argument("--state-dir", type=Path, default=REPO / "build" / "cluster" / "kubelet")
    p.add_argument("--pod-cidr", default="10.244.0.0/24")
    p.add_argument("--bridge", default="slip0", help="bridge name; also the prefix of its namespaces and veths")
    p.add_argument("--apiserver-relay-port", type=int, default=6443)
    p.add_argument("--backoff-base", type=float, default=10.0, help="first CrashLoopBackOff/ImagePullBackOff delay, s")
    p.add_argument("--backoff-max", type=float, default=300.0, help="longest back-off delay, s")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds between SIGTERM and SIGKILL for pods when the kubelet stops")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if os.geteuid() != 0:
        sys.exit("kubelet: must run as root (network namespaces, mounts, setuid)")
    kubelet = Kubelet(args)
    try:
        kubelet.start()
    except RuntimeError as err:
        sys.exit(f"kubelet: {err}")
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        kubelet.stopping.set()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=kubelet.watch_pods, name="pod-watch", daemon=True).start()
    threading.Thread(target=kubelet.names.run, name="endpointslice-watch", daemon=True).start()
    log.info("kubelet %s ready (state under %s)", args.node_name, kubelet.state_dir)
    done.wait()
    kubelet.shutdown()
    return 0
