"""The LeaderWorkerSet controller (kubernetes-sigs/lws, ``make cluster`` builds it into
``build/cluster/bin/lws-controller``) beside the local control plane, as its release installs it,
except where it runs: a host process, not a pod.

- The CRD is that release's own (``config/crd/bases`` of the Go module, copied by build.sh into
  ``build/cluster/lws``).
- Its webhooks (LeaderWorkerSet defaulting and validation; the pod webhook that labels a group's
  pods and injects ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``) serve on
  127.0.0.1 with a certificate from the cluster's CA; LWS's internal certificate management (a
  Secret and a Service in ``lws-system``, for a pod) is off. The Mutating- and
  ValidatingWebhookConfiguration are the release's (``config/webhook``: manifests.yaml with its
  kustomize patches, which limit the pod webhooks to pods labelled
  ``leaderworkerset.sigs.k8s.io/name``), names prefixed ``lws-`` as its kustomization does, with
  ``clientConfig.url`` in place of the in-cluster Service.
- No leader election (one replica), no metrics endpoint; the health probes on 127.0.0.1.
"""
from __future__ import annotations

import base64
import json
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from controlplane import BUILD, Component, ControlPlane, free_port, log_tail

CONFIG_DIR = BUILD / "lws"
CRD_FILE = "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRD_NAME = "leaderworkersets.leaderworkerset.x-k8s.io"
# What LWS's kustomization (config/default) prefixes every object's name with.
NAME_PREFIX = "lws-"
WEBHOOK_PATCHES = {"MutatingWebhookConfiguration": "mutating-patch.yaml",
                   "ValidatingWebhookConfiguration": "validating-patch.yaml"}

Kubectl = Callable[..., subprocess.CompletedProcess]


def missing_files(config_dir: Path = CONFIG_DIR) -> list[str]:
    """The files of ``build/cluster/lws`` not there (``make cluster`` copies them)."""
    return [n for n in (CRD_FILE, "manifests.yaml", *WEBHOOK_PATCHES.values()) if not (config_dir / n).is_file()]


def json_patch_replace(doc: dict, ops: list[dict]) -> dict:
    """``doc`` with RFC 6902 ``replace`` operations applied (the only op LWS's webhook patches
    use). Raises ValueError for another op or a path that does not exist."""
    for op in ops:
        if op.get("op") != "replace":
            raise ValueError(f"unsupported JSON patch op {op.get('op')!r} (only replace)")
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = op["value"]
        elif last in node:
            node[last] = op["value"]
        else:
            raise ValueError(f"JSON patch path {op['path']} does not exist")
    return doc


def webhook_configurations(config_dir: Path, base_url: str, ca_pem: bytes) -> list[dict]:
    """The release's Mutating- and ValidatingWebhookConfiguration with its patches applied,
    each webhook's ``clientConfig`` a URL (``base_url`` + the Service path it named) with
    ``ca_pem`` as its CA bundle."""
    docs = [d for d in yaml.safe_load_all((config_dir / "manifests.yaml").read_text()) if d]
    ca_bundle = base64.b64encode(ca_pem).decode()
    for doc in docs:
        json_patch_replace(doc, yaml.safe_load((config_dir / WEBHOOK_PATCHES[doc["kind"]]).read_text()))
        doc["metadata"]["name"] = NAME_PREFIX + doc["metadata"]["name"]
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": base_url.rstrip("/") + path, "caBundle": ca_bundle}
    return docs


def controller_config(webhook_port: int, health_port: int, cert_dir: Path) -> dict:
    """LWS's ``Configuration`` (config.lws.x-k8s.io/v1alpha1) for a host process: webhooks on
    127.0.0.1:``webhook_port`` with ``cert_dir``'s tls.crt/tls.key, its own certificate
    management off, no leader election, no metrics, health probes on 127.0.0.1:``health_port``."""
    return {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
    }


def make_serving_cert(pki: Path, out: Path) -> None:
    """``out/tls.key`` and ``out/tls.crt``: a certificate for IP 127.0.0.1 signed by the
    cluster's CA (``pki/ca.crt``, ``pki/ca.key``), where controller-runtime's webhook server
    looks for them. Raises CalledProcessError when openssl fails."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
                             "keyUsage=digitalSignature,keyEncipherment\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True)

    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr",
        "-subj", "/CN=lws-webhook")
    run("x509", "-req", "-in", "tls.csr", "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-out", "tls.crt", "-days", "365", "-extfile", "ext")


@dataclass
class LeaderWorkerSetController:
    """``lws-controller`` for ``plane``, started by :meth:`start` and stopped by :meth:`stop`;
    ``kubectl`` runs kubectl against the plane (``Cluster.kubectl``)."""
    plane: ControlPlane
    kubectl: Kubectl
    config_dir: Path = CONFIG_DIR
    component: Component | None = None

    @property
    def run_dir(self) -> Path:
        return self.plane.run_dir / "lws"

    def start(self, timeout: float = 120.0) -> None:
        """Installs the CRD, starts the controller, waits until its webhooks answer, then
        registers them. Raises RuntimeError (with the log's tail) when it does not come up
        within ``timeout`` seconds, or when ``make cluster`` has not copied LWS's files."""
        missing = missing_files(self.config_dir)
        if missing:
            raise RuntimeError(f"LeaderWorkerSet files missing in {self.config_dir}: {', '.join(missing)}; "
                               "run `make cluster`")
        deadline = time.monotonic() + timeout
        # Server-side: the CRD (1.2 MB) is above the 256 KiB of client-side apply's annotation.
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(self.config_dir / CRD_FILE))
        self._wait_established(deadline)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        make_serving_cert(self.plane.pki, self.run_dir / "certs")
        webhook_port, health_port = free_port(), free_port()
        config_file = self.run_dir / "config.yaml"
        config_file.write_text(json.dumps(controller_config(webhook_port, health_port, self.run_dir / "certs")))
        self.component = Component("lws-controller", [
            str(self.plane.bin_dir / "lws-controller"), "--config", str(config_file),
            "--kubeconfig", str(self.plane.kubeconfig), "--zap-devel=false", "--zap-log-level=info"],
            self.plane.run_dir / "lws-controller.log", self.plane.run_dir / "lws-controller.pid")
        self.component.start()
        base_url = f"https://127.0.0.1:{webhook_port}"
        self._wait_webhooks(base_url, deadline)
        docs = webhook_configurations(self.config_dir, base_url, (self.plane.pki / "ca.crt").read_bytes())
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))

    def _wait_established(self, deadline: float) -> None:
        """Until the CRD's Established condition is True (``kubectl wait`` errs while the new
        object has no conditions yet)."""
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        while time.monotonic() < deadline:
            if self.kubectl("get", "crd", CRD_NAME, "-o", f"jsonpath={jsonpath}", check=False).stdout == "True":
                return
            time.sleep(0.5)
        raise RuntimeError(f"CRD {CRD_NAME} not Established")

    def _wait_webhooks(self, base_url: str, deadline: float) -> None:
        """Until the LeaderWorkerSet validation path answers (anything but 404: the handlers are
        registered a moment after the server starts)."""
        ctx = ssl.create_default_context(cafile=str(self.plane.pki / "ca.crt"))
        url = f"{base_url}/validate-leaderworkerset-x-k8s-io-v1-leaderworkerset"
        while time.monotonic() < deadline:
            if not self.component.alive():
                raise RuntimeError(f"lws-controller exited:\n{log_tail(self.component.log)}")
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json"}), context=ctx, timeout=5):
                    return
            except urllib.error.HTTPError as err:
                if err.code != 404:
                    return
            except (OSError, socket.timeout):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"lws-controller's webhooks not serving at {base_url}:\n{log_tail(self.component.log)}")

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()
