"""Startup, readiness and liveness probes, with Kubernetes' timing and threshold semantics.

One ProbeWorker thread per probe of a running container, as the kubelet's prober workers: it
waits ``initialDelaySeconds`` from the container's start (liveness and readiness also wait for
the startup probe to succeed), then probes every ``periodSeconds`` with ``timeoutSeconds``; the
result flips after ``successThreshold`` consecutive successes or ``failureThreshold`` failures.
Until the first flip a readiness result is "not ready" and a liveness/startup result "alive".
"""
from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from typing import Callable

# (argv, timeout seconds) -> (exit code, combined output); None exit code means it timed out
ExecFn = Callable[[list[str], float], "tuple[int | None, str]"]


def resolve_port(port: int | str, container: dict) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} not found in the container's ports")


def http_get(action: dict, pod_ip: str, container: dict, timeout: float) -> tuple[bool, str]:
    host = action.get("host") or pod_ip
    port = resolve_port(action["port"], container)
    path = action.get("path") or "/"
    scheme = (action.get("scheme") or "HTTP").lower()
    url = f"{scheme}://{host}:{port}{path}"
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl._create_unverified_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"User-Agent": "kube-probe/1.36", "Accept": "*/*"}
    headers.update({h["name"]: h["value"] for h in action.get("httpHeaders") or []})
    try:
        conn.request("GET", path, headers=headers)
        status = conn.getresponse().status
    except socket.timeout:
        return False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
    except ConnectionRefusedError:
        return False, f'Get "{url}": dial tcp {host}:{port}: connect: connection refused'
    except OSError as err:
        return False, f'Get "{url}": {err}'
    finally:
        conn.close()
    if 200 <= status < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {status}"


def tcp_socket(action: dict, pod_ip: str, container: dict, timeout: float) -> tuple[bool, str]:
    host = action.get("host") or pod_ip
    port = resolve_port(action["port"], container)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True, ""
    except socket.timeout:
        return False, f"dial tcp {host}:{port}: i/o timeout"
    except ConnectionRefusedError:
        return False, f"dial tcp {host}:{port}: connect: connection refused"
    except OSError as err:
        return False, f"dial tcp {host}:{port}: {err}"


def exec_action(action: dict, run_exec: ExecFn, timeout: float) -> tuple[bool, str]:
    argv = action.get("command") or []
    code, output = run_exec(argv, timeout)
    if code is None:
        return False, f'command "{" ".join(argv)}" timed out'
    if code == 0:
        return True, ""
    return False, output.strip() or f'command "{" ".join(argv)}" exited with {code}'


def run_handler(handler: dict, pod_ip: str, container: dict, run_exec: ExecFn, timeout: float) -> tuple[bool, str]:
    """Runs a probe or lifecycle handler (exec, httpGet, tcpSocket) once: (success, message)."""
    try:
        if "exec" in handler:
            return exec_action(handler["exec"], run_exec, timeout)
        if "httpGet" in handler:
            return http_get(handler["httpGet"], pod_ip, container, timeout)
        if "tcpSocket" in handler:
            return tcp_socket(handler["tcpSocket"], pod_ip, container, timeout)
        if "sleep" in handler:
            time.sleep(min(float(handler["sleep"]["seconds"]), timeout))
            return True, ""
    except ValueError as err:
        return False, str(err)
    return False, f"unsupported handler: {', '.join(handler)}"


class ProbeWorker(threading.Thread):
    """Probes one container until stopped. ``on_event(kind, what, message)`` hears each failed
    probe (``"failed"``, for the Unhealthy event) and each flip (``"healthy"``, ``"unhealthy"``)."""

    def __init__(self, kind: str, spec: dict, probe: Callable[[float], tuple[bool, str]],
                 started_at: float, on_event: Callable[[str, str, str], None],
                 wait_for: threading.Event | None, stop: threading.Event):
        super().__init__(name=f"probe-{kind}", daemon=True)
        self.kind = kind                  # "Startup", "Readiness" or "Liveness"
        self.spec = spec
        self.probe = probe
        self.started_at = started_at      # time.monotonic() of the container's start
        self.on_event = on_event
        self.wait_for = wait_for          # set once the startup probe succeeded
        self.stop = stop
        self.result = kind == "Liveness"

    def run(self) -> None:
        if self.wait_for is not None:
            while not self.wait_for.wait(0.5):
                if self.stop.is_set():
                    return
        delay = self.started_at + self.spec.get("initialDelaySeconds", 0) - time.monotonic()
        if delay > 0 and self.stop.wait(delay):
            return
        period = self.spec.get("periodSeconds", 10)
        timeout = self.spec.get("timeoutSeconds", 1)
        oks = fails = 0
        while not self.stop.is_set():
            ok, message = self.probe(timeout)
            if self.stop.is_set():
                return
            if ok:
                oks, fails = oks + 1, 0
                if not self.result and oks >= self.spec.get("successThreshold", 1):
                    self.result = True
                    self.on_event(self.kind, "healthy", "")
                    if self.kind == "Startup":
                        return
            else:
                oks, fails = 0, fails + 1
                self.on_event(self.kind, "failed", message)
                if fails >= self.spec.get("failureThreshold", 3) and (self.result or self.kind != "Readiness"):
                    self.result = False
                    self.on_event(self.kind, "unhealthy", message)
                    if self.kind != "Readiness":
                        return  # the container is killed; its restart gets new workers
            self.stop.wait(period)
