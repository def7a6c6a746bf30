"""The local test cluster: the control plane (``controlplane.py``) plus one process kubelet
(``kubelet.py``) whose pods are local processes, each in its own network and mount namespace.

    .venv/bin/python e2e/cluster/cluster.py up [--gpus N] [--lws]   # then: export KUBECONFIG=build/cluster/kubeconfig
    .venv/bin/python e2e/cluster/cluster.py down

``--lws`` adds the LeaderWorkerSet controller (``lws.py``) that InferenceServices with
``parallelism.pipeline`` > 1 need; it is off by default (its 1.2 MB CRD costs the API server
seconds of CPU, and most tests do not need it). Needs root (network namespaces, bind mounts) and the binaries of ``make cluster``. The pytest
fixture in ``tests/cluster/conftest.py`` uses :class:`Cluster` the same way.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controlplane import (  # noqa: E402
    BIN, BUILD, POD_GATEWAY_IP, REPO, Component, ControlPlane, log_tail, missing_binaries,
    stop_from_pid_files)
from lws import LeaderWorkerSetController  # noqa: E402

NODE_NAME = "node-1"
RELAY_PORT = 6443


def why_not_runnable() -> str | None:
    """None when this machine can run the cluster; else what is missing, in one sentence."""
    missing = missing_binaries()
    if missing:
        return f"control-plane binaries missing ({', '.join(missing)}): run `make cluster`"
    if os.geteuid() != 0:
        return "the process kubelet needs root (network namespaces and bind mounts)"
    for tool in ("ip", "unshare", "nsenter", "openssl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@dataclass
class Cluster:
    """A running control plane and kubelet; ``kubectl``/``helm`` run against it. ``lws``: start
    the LeaderWorkerSet controller too (or later, :meth:`start_lws`)."""
    gpus: int = 0
    lws: bool = False
    python: str = str(REPO / ".venv" / "bin" / "python")
    plane: ControlPlane = field(default_factory=ControlPlane)
    kubelet: Component | None = None
    lws_controller: LeaderWorkerSetController | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    @property
    def state_dir(self) -> Path:
        return self.plane.run_dir / "kubelet"

    def start(self, timeout: float = 180.0) -> None:
        self.plane.start()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.kubelet = Component(
            "kubelet",
            [self.python, "-I", str(REPO / "e2e" / "cluster" / "kubelet.py"),
             "--kubeconfig", str(self.kubeconfig), "--node-name", NODE_NAME,
             "--gpus", str(self.gpus), "--state-dir", str(self.state_dir),
             "--apiserver-relay-port", str(RELAY_PORT)],
            self.plane.run_dir / "kubelet.log", self.plane.run_dir / "kubelet.pid")
        self.kubelet.start()
        self.wait_node_ready(timeout)
        if self.lws:
            self.start_lws()

    def start_lws(self, timeout: float = 120.0) -> None:
        """Installs LeaderWorkerSet's CRD and webhooks and starts its controller (once; later
        calls return at once). Raises RuntimeError when it does not come up."""
        if self.lws_controller is not None and self.lws_controller.component.alive():
            return
        self.lws_controller = LeaderWorkerSetController(self.plane, self.kubectl)
        self.lws_controller.start(timeout)

    def wait_node_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.kubelet and not self.kubelet.alive():
                raise RuntimeError(f"kubelet exited:\n{log_tail(self.kubelet.log)}")
            out = self.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
            if out.returncode == 0:
                conds = json.loads(out.stdout)["status"].get("conditions", [])
                if any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                    return
            time.sleep(1)
        raise RuntimeError(f"node {NODE_NAME} not Ready after {timeout:.0f} s:\n"
                           f"{log_tail(self.plane.run_dir / 'kubelet.log')}")

    def stop(self) -> None:
        if self.lws_controller:
            self.lws_controller.stop()
        if self.kubelet:
            self.kubelet.stop(timeout=60)
        self.plane.stop()

    def env(self) -> dict[str, str]:
        """The environment for kubectl, helm and clients: this cluster's kubeconfig, our binaries
        first on PATH, helm's state under build/cluster."""
        env = dict(os.environ)
        env.update(KUBECONFIG=str(self.kubeconfig), PATH=f"{BIN}:{env.get('PATH', '')}",
                   HELM_CACHE_HOME=str(BUILD / "helm" / "cache"),
                   HELM_CONFIG_HOME=str(BUILD / "helm" / "config"),
                   HELM_DATA_HOME=str(BUILD / "helm" / "data"))
        return env

    def api_client(self):
        """A ``kubernetes.client.ApiClient`` logged in as the admin."""
        from kubernetes import config
        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        return self._run("kubectl", args, input, check, timeout)

    def helm(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return self._run("helm", args, None, check, timeout)

    def _run(self, tool: str, args: tuple[str, ...], input: str | None, check: bool,
             timeout: float) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(BIN / tool), *args], input=input, capture_output=True,
                              text=True, env=self.env(), timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} exited {proc.returncode}:\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc


def running_components(run_dir: Path) -> list[str]:
    """Names of the components whose PID file in ``run_dir`` names a live process."""
    alive = []
    for pid_file in sorted(run_dir.glob("*.pid")):
        try:
            os.kill(int(pid_file.read_text().strip()), 0)
            alive.append(pid_file.stem)
        except (OSError, ValueError):
            continue
    return alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity of the node")
    parser.add_argument("--lws", action="store_true", help="run the LeaderWorkerSet controller too")
    args = parser.parse_args(argv)
    cluster = Cluster(gpus=args.gpus, lws=args.lws)
    if args.command == "down":
        running = running_components(cluster.plane.run_dir)
        stop_from_pid_files(cluster.plane.run_dir)
        print(f"stopped {', '.join(running)}" if running else "no cluster was running")
        return 0
    reason = why_not_runnable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    if running_components(cluster.plane.run_dir):
        print(f"error: a cluster is already running ({', '.join(running_components(cluster.plane.run_dir))}); "
              "`make cluster-down` first", file=sys.stderr)
        return 1
    try:
        cluster.start()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        cluster.stop()
        return 1
    print(f"cluster up: API at {cluster.plane.server}, node {NODE_NAME} "
          f"(pods on {POD_GATEWAY_IP}/24){', LeaderWorkerSet controller' if args.lws else ''}\nexport KUBECONFIG={cluster.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
