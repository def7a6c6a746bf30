"""Names in a pod: its hostname, the ``/etc/hosts`` the kubelet writes for it, and — this node
runs no cluster DNS — the records cluster DNS would answer for pods behind headless Services.

Kubernetes' rules, as they are kept here:

- A pod's hostname is ``spec.hostname`` or its name (cut to 63 characters); with
  ``spec.subdomain`` its FQDN is ``HOSTNAME.SUBDOMAIN.NAMESPACE.svc.cluster.local``. The kubelet's
  managed ``/etc/hosts`` maps the pod's IP to the FQDN and the hostname, after the localhost
  lines and before ``spec.hostAliases``. Each container gets its own UTS namespace with that
  hostname (``launcher.py``), so ``gethostname()`` resolves to the pod's IP, which is what
  gloo and NCCL bind to.
- Cluster DNS (CoreDNS's kubernetes plugin) answers ``HOSTNAME.SERVICE.NAMESPACE.svc.cluster.local``
  with the address of each ready endpoint that has a ``hostname`` in the EndpointSlices of a
  headless Service (the EndpointSlice controller sets it when a pod's hostname and subdomain
  name the Service): how a LeaderWorkerSet's workers reach ``LWS_LEADER_ADDRESS``. Here the
  kubelet watches those EndpointSlices (:class:`HeadlessRecords`) and writes the records into
  every pod's hosts file, rewritten in place (the bind mount follows the file) when they change.
- A pod resolves short names through the search list ``NAMESPACE.svc.cluster.local
  svc.cluster.local cluster.local``; ``/etc/hosts`` has no search list (glibc applies it to DNS
  queries only), so each record is written under every name that the list completes to it
  (``h.s.ns`` for ``h.s.ns.svc.cluster.local``), the pod's own included.
- A ClusterFirst pod's ``/etc/resolv.conf`` names the cluster's DNS server and that search list.
  Here it names the node's address on the pod network, where no DNS server listens: a name that
  is not in ``/etc/hosts`` fails at once (port unreachable) instead of after the timeouts of a
  host resolver the pod's network cannot reach.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable, Iterable

from kubernetes import client
from kubernetes.watch import Watch

log = logging.getLogger("kubelet.names")
CLUSTER_DOMAIN = "cluster.local"
HOSTNAME_MAX = 63
# The label the EndpointSlice controller puts on the slices of a headless Service.
HEADLESS_LABEL = "service.kubernetes.io/headless"
LOCALHOST_LINES = (
    "127.0.0.1\tlocalhost",
    "::1\tlocalhost ip6-localhost ip6-loopback",
    "fe00::0\tip6-localnet",
    "fe00::0\tip6-mcastprefix",
    "fe00::1\tip6-allnodes",
    "fe00::2\tip6-allrouters",
)


def pod_hostname(pod: dict) -> str:
    """``spec.hostname``, else the pod's name, at most 63 characters (trailing ``-``/``.`` cut)."""
    name = pod["spec"].get("hostname") or pod["metadata"]["name"]
    return name[:HOSTNAME_MAX].rstrip("-.") if len(name) > HOSTNAME_MAX else name


def pod_fqdn(pod: dict) -> str | None:
    """``HOSTNAME.SUBDOMAIN.NAMESPACE.svc.cluster.local``; None without ``spec.subdomain``."""
    subdomain = pod["spec"].get("subdomain")
    if not subdomain:
        return None
    return f"{pod_hostname(pod)}.{subdomain}.{pod['metadata']['namespace']}.svc.{CLUSTER_DOMAIN}"


def search_list(namespace: str) -> list[str]:
    """The DNS search domains of a pod in ``namespace`` (ClusterFirst policy)."""
    return [f"{namespace}.svc.{CLUSTER_DOMAIN}", f"svc.{CLUSTER_DOMAIN}", CLUSTER_DOMAIN]


def names_for(fqdn: str, namespace: str) -> list[str]:
    """``fqdn`` and each shorter name that a pod in ``namespace`` completes to it through its
    search list, longest first."""
    shorter = [fqdn[:-len(d) - 1] for d in search_list(namespace) if fqdn.endswith("." + d)]
    return [fqdn, *sorted(shorter, key=len, reverse=True)]


def records_from_slices(slices: Iterable[dict]) -> dict[str, str]:
    """``{FQDN: address}`` of the ready endpoints with a hostname in EndpointSlices of headless
    Services (a missing ``ready`` condition counts as ready, as the API says)."""
    records = {}
    for s in slices:
        meta = s["metadata"]
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not service:
            continue
        for endpoint in s.get("endpoints") or []:
            hostname, addresses = endpoint.get("hostname"), endpoint.get("addresses") or []
            if hostname and addresses and (endpoint.get("conditions") or {}).get("ready") is not False:
                records[f"{hostname}.{service}.{meta['namespace']}.svc.{CLUSTER_DOMAIN}"] = addresses[0]
    return records


def hosts_file(pod: dict, pod_ip: str, records: dict[str, str]) -> str:
    """The pod's ``/etc/hosts``: the kubelet's managed content (localhost, the pod's IP with its
    FQDN and hostname, ``hostAliases``), then ``records`` (FQDN → address, the headless Services'
    pods, this one's too) under the names the pod's search list reaches them by."""
    hostname, fqdn = pod_hostname(pod), pod_fqdn(pod)
    lines = ["# Kubernetes-managed hosts file.", *LOCALHOST_LINES,
             f"{pod_ip}\t{fqdn}\t{hostname}" if fqdn else f"{pod_ip}\t{hostname}"]
    aliases = pod["spec"].get("hostAliases") or []
    if aliases:
        lines.append("\n# Entries added by HostAliases.")
        lines += [f"{a['ip']}\t" + "\t".join(a.get("hostnames") or []) for a in aliases]
    namespace = pod["metadata"]["namespace"]
    if records:
        lines.append("\n# Cluster DNS: pods of headless Services (the process kubelet's stand-in).")
        lines += [f"{ip}\t" + "\t".join(names_for(f, namespace)) for f, ip in sorted(records.items())]
    return "\n".join(lines) + "\n"


def cluster_first(pod: dict) -> bool:
    """Whether the pod's DNS is the cluster's (dnsPolicy ClusterFirst, the default, off the
    host network; ClusterFirstWithHostNet on it); else it keeps the node's resolv.conf."""
    policy = pod["spec"].get("dnsPolicy") or "ClusterFirst"
    if pod["spec"].get("hostNetwork"):
        return policy == "ClusterFirstWithHostNet"
    return policy in ("ClusterFirst", "ClusterFirstWithHostNet")


def resolv_conf(namespace: str, nameserver: str) -> str:
    """A ClusterFirst pod's ``/etc/resolv.conf``: ``nameserver``, the search list, ndots 5 (the
    kubelet's), one try of one second."""
    return (f"nameserver {nameserver}\nsearch {' '.join(search_list(namespace))}\n"
            "options ndots:5 timeout:1 attempts:1\n")


def write_in_place(path: Path, text: str) -> None:
    """Rewrites ``path`` keeping its inode (a bind mount of it shows the new text; a rename
    would leave the container on the old file). Mode 0644: containers of any user read it."""
    if not path.exists() or path.read_text() != text:
        with open(path, "w") as f:
            f.write(text)
        path.chmod(0o644)


class HeadlessRecords:
    """The cluster-DNS records of headless Services' pods (:func:`records_from_slices`), kept
    current by a list-and-watch of their EndpointSlices in every namespace; ``on_change(records)``
    is called (from the watch thread) whenever they change."""

    def __init__(self, api: client.ApiClient, on_change: Callable[[dict[str, str]], None],
                 stopping: threading.Event):
        self.discovery = client.DiscoveryV1Api(api)
        self.on_change = on_change
        self.stopping = stopping
        self.records: dict[str, str] = {}
        self._slices: dict[str, dict] = {}

    def run(self) -> None:
        """List, then watch for a minute, again, until ``stopping`` is set (after an error too)."""
        while not self.stopping.is_set():
            try:
                listed = json.loads(self.discovery.list_endpoint_slice_for_all_namespaces(
                    label_selector=HEADLESS_LABEL, _preload_content=False).data)
                self._slices = {s["metadata"]["uid"]: s for s in listed["items"]}
                self._publish()
                self._watch(listed["metadata"]["resourceVersion"])
            except Exception as err:  # noqa: BLE001 - the API server may be restarting
                if not self.stopping.is_set():
                    log.warning("EndpointSlice watch: %s; relisting", err)
                    self.stopping.wait(1.0)

    def _watch(self, rv: str) -> None:
        watcher = Watch()
        for event in watcher.stream(self.discovery.list_endpoint_slice_for_all_namespaces,
                                    label_selector=HEADLESS_LABEL, resource_version=rv,
                                    timeout_seconds=60, _request_timeout=90, deserialize=False):
            obj = event["object"]
            if event["type"] == "ERROR":
                return  # 410 Gone and friends: relist
            if event["type"] == "DELETED":
                self._slices.pop(obj["metadata"]["uid"], None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                self._slices[obj["metadata"]["uid"]] = obj
            self._publish()
            if self.stopping.is_set():
                watcher.stop()
                return

    def _publish(self) -> None:
        records = records_from_slices(self._slices.values())
        if records != self.records:
            self.records = records
            self.on_change(records)
