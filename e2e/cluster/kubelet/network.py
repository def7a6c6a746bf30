"""Pod networking: one Linux bridge whose host side is the pod network's gateway, one network
namespace per pod joined to it by a veth pair, addresses from the pod CIDR; and a TCP relay on
the gateway to the API server (which listens on 127.0.0.1 only), so in-cluster clients reach it
at ``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT``.

Every name starts with the bridge's name, so start-up removes only what an earlier run of this
kubelet (same ``--bridge``) left behind; a lock per bridge name (:meth:`PodNetwork.claim`) keeps
a second kubelet from removing the network of one that still runs.
"""
from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import logging
import os
import select
import socket
import subprocess
import threading
from pathlib import Path

log = logging.getLogger("kubelet.network")
LOCK_DIR = Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class PodNetwork:
    """The bridge, the address pool and each pod's namespace."""

    def __init__(self, bridge: str, cidr: str):
        if len(bridge) > 6:
            raise ValueError(f"--bridge must be at most 6 characters (veth names are {bridge}-XXXXXXXX), got {bridge!r}")
        self.bridge = bridge
        self.net = ipaddress.ip_network(cidr)
        hosts = self.net.hosts()
        self.gateway = str(next(hosts))
        self._free = [str(a) for a in hosts]
        self._used: dict[str, str] = {}    # pod uid -> address
        self._lock = threading.Lock()

    def netns(self, uid: str) -> str:
        return f"{self.bridge}-{uid}"

    def _veth(self, uid: str) -> str:
        return f"{self.bridge}-{hashlib.sha1(uid.encode()).hexdigest()[:8]}"

    def claim(self) -> None:
        """Takes this bridge name's lock for the life of the process. Raises RuntimeError when
        another kubelet holds it (its pods' namespaces and veths must not be removed)."""
        path = LOCK_DIR / f"slipstream-kubelet-{self.bridge}.lock"
        self._lock_fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(f"another kubelet runs the pod network on bridge {self.bridge} (it holds {path}): "
                               "stop it first (`make cluster-down`), or give this one another --bridge") from None

    def setup(self) -> None:
        """Removes what an earlier run left, then creates the bridge with the gateway address."""
        self.cleanup()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def cleanup(self) -> None:
        """Deletes every namespace, veth and the bridge of this ``--bridge`` name."""
        for line in ip("netns", "list", check=False).stdout.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(f"{self.bridge}-"):
                ip("netns", "delete", name, check=False)
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name == self.bridge or name.startswith(f"{self.bridge}-"):
                ip("link", "delete", name, check=False)

    def create(self, uid: str, prefer: str | None = None) -> str:
        """A namespace for pod ``uid`` with ``lo`` up and ``eth0`` on the bridge; its address:
        ``prefer`` when free (a pod's IP cannot change once reported, e.g. across a restart)."""
        with self._lock:
            if uid in self._used:
                return self._used[uid]
            if not self._free:
                raise RuntimeError(f"no free address in {self.net}")
            addr = prefer if prefer in self._free else self._free[0]
            self._free.remove(addr)
            self._used[uid] = addr
        ns, veth = self.netns(uid), self._veth(uid)
        try:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "route", "add", "default", "via", self.gateway)
        except subprocess.CalledProcessError as err:
            self.delete(uid)
            raise RuntimeError(f"{' '.join(err.cmd)}: {err.stderr.strip()}") from err
        return addr

    def delete(self, uid: str) -> None:
        """Removes the pod's namespace and veth and frees its address."""
        ip("netns", "delete", self.netns(uid), check=False)
        ip("link", "delete", self._veth(uid), check=False)
        with self._lock:
            addr = self._used.pop(uid, None)
            if addr:
                self._free.append(addr)


class Relay:
    """Forwards TCP connections from ``listen`` to ``target`` (host, port), one thread each."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.target = target
        self.server = socket.create_server(listen, reuse_port=False)
        self._stopped = False

    def start(self) -> None:
        threading.Thread(target=self._accept, name="relay", daemon=True).start()

    def stop(self) -> None:
        self._stopped = True
        self.server.close()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
        except OSError as err:
            log.warning("relay: cannot reach %s:%s: %s", *self.target, err)
            client.close()
            return
        socks = [client, upstream]
        try:
            while True:
                readable, _, _ = select.select(socks, [], [])
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    (upstream if s is client else client).sendall(data)
        except OSError:
            pass
        finally:
            for s in socks:
                s.close()

