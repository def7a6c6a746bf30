"""A real Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver, kube-controller-manager and
kube-scheduler, built from source by ``make cluster`` into ``build/cluster/bin``.

The API server runs as a production cluster's does, within what one machine allows: TLS, token
authentication (an admin in ``system:masters``), ServiceAccount tokens signed by its own key, RBAC
authorization, the default admission plugins plus those that kubeadm and managed distributions
(OpenShift, GKE, EKS) turn on, and an audit log of every request's metadata (``audit.log``: the
quickest way to list every call a client made and every 403). Everything listens on 127.0.0.1
only; pods reach the API through the process kubelet's relay (``kubelet.py``).

Standard library only, so that it runs from any Python:

    python e2e/cluster/controlplane.py up      # starts it, writes build/cluster/kubeconfig
    python e2e/cluster/controlplane.py down    # stops it by PID
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "cluster"
BIN = BUILD / "bin"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm",
            "crane", "registry", "lws-controller")

SERVICE_CIDR = "10.0.0.0/24"
# The ``kubernetes`` Service's ClusterIP (first address of SERVICE_CIDR) and the pod network's
# gateway, where the kubelet relays to the API server: both are in the serving certificate.
KUBERNETES_SERVICE_IP = "10.0.0.1"
POD_GATEWAY_IP = "10.244.0.1"

# The default set of 1.36 plus what kubeadm (NodeRestriction) and managed distributions enable:
# OwnerReferencesPermissionEnforcement (OpenShift: setting blockOwnerDeletion needs `update` on
# the owner's finalizers), ExtendedResourceToleration (GPU node pools), PodNodeSelector and
# PodTolerationRestriction (OpenShift projects), AlwaysPullImages and DenyServiceExternalIPs.
ADMISSION_PLUGINS = (
    "NamespaceLifecycle,LimitRanger,ServiceAccount,TaintNodesByCondition,PodSecurity,Priority,"
    "DefaultTolerationSeconds,DefaultStorageClass,StorageObjectInUseProtection,"
    "PersistentVolumeClaimResize,RuntimeClass,CertificateApproval,CertificateSigning,"
    "ClusterTrustBundleAttest,CertificateSubjectRestriction,DefaultIngressClass,"
    "MutatingAdmissionPolicy,MutatingAdmissionWebhook,ValidatingAdmissionPolicy,"
    "ValidatingAdmissionWebhook,ResourceQuota,"
    "NodeRestriction,OwnerReferencesPermissionEnforcement,ExtendedResourceToleration,"
    "PodNodeSelector,PodTolerationRestriction,AlwaysPullImages,DenyServiceExternalIPs"
)

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    users: ["system:kube-controller-manager", "system:kube-scheduler", "system:apiserver"]
  - level: None
    nonResourceURLs: ["/readyz*", "/livez*", "/healthz*", "/version"]
  - level: Metadata
"""


def missing_binaries(bin_dir: Path = BIN) -> list[str]:
    """Names of the control-plane binaries not built yet (``make cluster`` builds them)."""
    return [name for name in BINARIES if not os.access(bin_dir / name, os.X_OK)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(pki: Path) -> None:
    """A CA, the API server's serving certificate and the ServiceAccount signing key pair.

    Made once and kept (``build/cluster/pki``), so kubeconfigs stay valid across restarts."""
    if (pki / "apiserver.crt").exists() and (pki / "sa.pub").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "3650", "-subj", "/CN=slipstream-test-ca", cwd=pki)
    sans = ",".join([
        "IP:127.0.0.1", f"IP:{KUBERNETES_SERVICE_IP}", f"IP:{POD_GATEWAY_IP}", "DNS:localhost",
        "DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
        "DNS:kubernetes.default.svc.cluster.local"])
    (pki / "apiserver.ext").write_text(
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out",
             "apiserver.csr", "-subj", "/CN=kube-apiserver", cwd=pki)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "apiserver.crt", "-days", "3650", "-extfile",
             "apiserver.ext", cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig_text(server: str, ca_file: Path, token: str, user: str = "admin") -> str:
    """A kubeconfig (JSON is YAML) for ``server`` with a bearer token."""
    ca = base64.b64encode(ca_file.read_bytes()).decode()
    return json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "slipstream-test",
                      "cluster": {"server": server, "certificate-authority-data": ca}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "slipstream-test",
                      "context": {"cluster": "slipstream-test", "user": user}}],
        "current-context": "slipstream-test",
    }, indent=2) + "\n"


@dataclass
class Component:
    """One control-plane process, started in its own session so it can be stopped as a group."""
    name: str
    argv: list[str]
    log: Path
    pid_file: Path
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid_file.write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        pid = self.proc.pid if self.proc else _read_pid(self.pid_file)
        if pid:
            stop_pid(pid, timeout)
        if self.proc:
            self.proc.poll()
        self.pid_file.unlink(missing_ok=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM the process group of ``pid``, SIGKILL after ``timeout`` seconds."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    return
            except ChildProcessError:  # not our child: poll for it
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler on 127.0.0.1.

    ``start()`` wipes ``run_dir`` (etcd's data included), starts all four, waits for
    ``/readyz`` and writes the admin kubeconfig; ``stop()`` ends them by PID.
    ``restart_apiserver()`` stops and starts the API server alone (etcd keeps the data).
    """
    build: Path = BUILD
    bin_dir: Path = BIN
    run_dir: Path = field(default_factory=lambda: BUILD / "run")
    components: dict[str, Component] = field(default_factory=dict)
    api_port: int = 0
    token: str = ""
    apiserver_flags: list[str] = field(default_factory=list)  # after the defaults, e.g. --feature-gates

    @property
    def pki(self) -> Path:
        return self.build / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.build / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def audit_log(self) -> Path:
        return self.run_dir / "audit.log"

    def start(self, timeout: float = 120.0) -> None:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise RuntimeError(f"control-plane binaries missing in {self.bin_dir}: "
                               f"{', '.join(missing)}; run `make cluster`")
        stop_from_pid_files(self.run_dir)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        make_pki(self.pki)
        self.token = secrets.token_hex(16)
        (self.run_dir / "tokens.csv").write_text(f'{self.token},admin,1,"system:masters"\n')
        (self.run_dir / "audit-policy.yaml").write_text(AUDIT_POLICY)
        self.api_port = free_port()
        self.kubeconfig.write_text(kubeconfig_text(self.server, self.pki / "ca.crt", self.token))
        self.kubeconfig.chmod(0o600)
        etcd_client, etcd_peer = free_port(), free_port()
        self._add("etcd", [
            "--data-dir", str(self.run_dir / "etcd"), "--name", "default",
            "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
            "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
            "--quota-backend-bytes", str(2 << 30), "--log-level", "warn"])
        self._add("kube-apiserver", self._apiserver_args(etcd_client))
        common = ["--kubeconfig", str(self.kubeconfig), "--bind-address", "127.0.0.1",
                  "--leader-elect=false", "-v", "1"]
        self._add("kube-controller-manager", [
            *common, "--secure-port", str(free_port()),
            "--service-account-private-key-file", str(self.pki / "sa.key"),
            "--root-ca-file", str(self.pki / "ca.crt"),
            # Each controller acts under its own ServiceAccount and RBAC, as in production.
            "--use-service-account-credentials=true", "--controllers=*",
            "--cluster-cidr", "10.244.0.0/16", "--service-cluster-ip-range", SERVICE_CIDR])
        self._add("kube-scheduler", [*common, "--secure-port", str(free_port())])
        self.components["etcd"].start()
        self.components["kube-apiserver"].start()
        self.wait_ready(timeout)
        self.components["kube-controller-manager"].start()
        self.components["kube-scheduler"].start()
        self._write_state()

    def _apiserver_args(self, etcd_client: int) -> list[str]:
        p = self.pki
        return [
            "--etcd-servers", f"http://127.0.0.1:{etcd_client}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(self.api_port),
            "--tls-cert-file", str(p / "apiserver.crt"), "--tls-private-key-file", str(p / "apiserver.key"),
            "--client-ca-file", str(p / "ca.crt"),
            "--token-auth-file", str(self.run_dir / "tokens.csv"),
            "--authorization-mode", "Node,RBAC",
            "--enable-admission-plugins", ADMISSION_PLUGINS,
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(p / "sa.pub"),
            "--service-account-signing-key-file", str(p / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--allow-privileged=false", "--profiling=false",
            # The node's InternalIP only: a Hostname address would send a DNS lookup off the
            # machine (kubectl logs/exec reach nothing here: the process kubelet serves no API).
            "--kubelet-preferred-address-types", "InternalIP",
            "--audit-policy-file", str(self.run_dir / "audit-policy.yaml"),
            "--audit-log-path", str(self.audit_log), "--audit-log-maxsize", "200",
            # Lets the relay in front of the server keep long watches open.
            "--min-request-timeout", "300",
            "--event-ttl", "1h", "-v", "1",
            *self.apiserver_flags,
        ]

    def _add(self, name: str, args: list[str]) -> None:
        self.components[name] = Component(
            name, [str(self.bin_dir / name), *args], self.run_dir / f"{name}.log",
            self.run_dir / f"{name}.pid")

    def _write_state(self) -> None:
        (self.run_dir / "state.json").write_text(json.dumps({
            "server": self.server, "kubeconfig": str(self.kubeconfig),
            "pids": {n: c.proc.pid for n, c in self.components.items() if c.proc}}, indent=2))

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the API server answers ``/readyz`` 200; raise with its log's tail if not."""
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        req = urllib.request.Request(f"{self.server}/readyz",
                                     headers={"Authorization": f"Bearer {self.token}"})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in ("etcd", "kube-apiserver"):
                if not self.components[name].alive():
                    raise RuntimeError(f"{name} exited:\n{log_tail(self.components[name].log)}")
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kube-apiserver not ready after {timeout:.0f} s:\n"
                           f"{log_tail(self.components['kube-apiserver'].log)}")

    def restart_apiserver(self, down_seconds: float = 0.0, timeout: float = 120.0) -> None:
        """Stop the API server (SIGTERM), wait ``down_seconds``, start it again on the same port."""
        api = self.components["kube-apiserver"]
        api.stop()
        time.sleep(down_seconds)
        api.start()
        self.wait_ready(timeout)
        self._write_state()

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            if name in self.components:
                self.components[name].stop()


def stop_from_pid_files(run_dir: Path) -> None:
    """Stops whatever an earlier ``up`` left running in ``run_dir`` (its PID files): the
    kubelet first (its pods' deletion needs the API server), etcd last."""
    order = ["kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"]
    pid_files = sorted(run_dir.glob("*.pid"),
                       key=lambda p: order.index(p.stem) if p.stem in order else -1)
    for pid_file in pid_files:
        pid = _read_pid(pid_file)
        if pid:
            stop_pid(pid, 60.0 if pid_file.stem == "kubelet" else 10.0)
        pid_file.unlink(missing_ok=True)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down"])
    args = parser.parse_args(argv)
    plane = ControlPlane()
    if args.command == "down":
        stop_from_pid_files(plane.run_dir)
        return 0
    try:
        plane.start()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        plane.stop()
        return 1
    print(f"control plane up at {plane.server}\nexport KUBECONFIG={plane.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
