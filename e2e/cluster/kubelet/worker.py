"""One pod's life on this node, on its own thread: sandbox (network namespace, volumes), init
containers in order, app containers with restarts and back-off, probes, status, and deletion
(preStop, SIGTERM, grace period, SIGKILL, removal of the pod object).

Native sidecars (init containers with ``restartPolicy: Always``, KEP-753) start in their place in
the init order and the next container waits until they have *started*; they are restarted
whenever they exit, whatever the pod's restartPolicy; at deletion, and when no app container will
run again, they are stopped after the app containers, in reverse order.

The worker reads ``self.pod`` (the latest object from the watch) and writes only the pod's
status (when it changed), its Events, and finally its deletion.
"""
from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Protocol

from kubernetes import client
from kubernetes.client.rest import ApiException

from . import names, volumes
from .container import Container, StartRefused, resolve_user
from .env import ConfigError, command_line, container_env
from .events import EventRecorder
from .images import ImagePullError, resolve
from .network import PodNetwork
from .objects import Objects
from .probes import ProbeWorker, run_handler
from .status import pod_status, rfc3339

log = logging.getLogger("kubelet.pod")
PROBES = (("Startup", "startupProbe"), ("Readiness", "readinessProbe"), ("Liveness", "livenessProbe"))
MIN_GRACE_S = 2.0  # the kubelet's minimumGracePeriodInSeconds after a preStop hook


def go_duration(seconds: float) -> str:
    """Seconds as Go prints a time.Duration: ``10s``, ``2m40s``, ``5m0s``."""
    s = int(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def pod_dir(state_dir: Path, namespace: str, name: str, uid: str) -> Path:
    return state_dir / "pods" / f"{namespace}_{name}_{uid}"


class Node(Protocol):
    """What a pod worker uses of its kubelet (``main.Kubelet``): the node's API clients, network,
    directories and restart back-off (seconds), and :meth:`forget` to drop a finished worker."""

    core: client.CoreV1Api
    objects: Objects
    events: EventRecorder
    network: PodNetwork
    names: names.HeadlessRecords
    host_ip: str
    ca_pem: bytes
    state_dir: Path
    repo: Path
    image_paths: list[Path]
    exposed: list[dict]
    backoff_base: float
    backoff_max: float
    shutdown_grace: float

    def service_env(self) -> dict[str, str]: ...

    def forget(self, uid: str) -> None: ...


class PodWorker(threading.Thread):
    def __init__(self, kubelet: Node, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.k = kubelet
        self.pod = pod
        self.uid = meta["uid"]
        self.key = f"{meta['name']}_{meta['namespace']}({self.uid})"
        self.dir = pod_dir(kubelet.state_dir, meta["namespace"], meta["name"], self.uid)
        self.wake = threading.Event()
        self.gone = False          # the object was removed from the API
        self.shutdown = False      # the kubelet is stopping
        self.pod_ip: str | None = None
        self.start_time = rfc3339()
        self.sandbox_ready = False
        self.finished = False
        self.init_failed = False
        self.initialized = False   # the init sequence is through: app containers may start
        self.apps_done = False     # no app container will run again: sidecars are not restarted
        self.volumes: dict[str, volumes.HostVolume] = {}
        self.hosts_lock = threading.Lock()
        self.hosts_closed = False  # torn down: the hosts file is not written again
        self.last_status: dict | None = None
        self.init = [Container(c, True, self.dir / c["name"]) for c in pod["spec"].get("initContainers") or []]
        self.app = [Container(c, False, self.dir / c["name"]) for c in pod["spec"]["containers"]]
        for c in self.init + self.app if self.init else []:
            c.view.state = {"waiting": {"reason": "PodInitializing"}}

    # ---- called from the watch thread -------------------------------------------------------
    def update(self, pod: dict) -> None:
        self.pod = pod
        self.wake.set()

    def removed(self) -> None:
        self.gone = True
        self.wake.set()

    def stop_for_shutdown(self) -> None:
        self.shutdown = True
        self.wake.set()

    # ---- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._live()
        except Exception:  # noqa: BLE001 - one pod's failure must not stop the kubelet
            log.exception("pod %s: worker failed", self.key)
        finally:
            self._teardown()
            self.k.forget(self.uid)

    def _live(self) -> None:
        self._sync_status()
        retry = 1.0
        while not self._create_sandbox():
            if self._leaving():
                break
            self.wake.wait(retry)
            retry = min(retry * 2, 30.0)
        while True:
            if self.shutdown:
                return self._stop_all(self.k.shutdown_grace, run_prestop=False)
            if self.gone:
                return self._stop_all(MIN_GRACE_S, run_prestop=False)
            if self.pod["metadata"].get("deletionTimestamp"):
                return self._terminate()
            if not self.finished:
                self._sync_containers()
            self._sync_status()
            self.wake.wait(0.5)
            self.wake.clear()

    def _leaving(self) -> bool:
        return self.shutdown or self.gone or bool(self.pod["metadata"].get("deletionTimestamp"))

    def _emit(self, type_: str, reason: str, message: str, c: Container | None = None) -> None:
        field = None if c is None else f"spec.{'initContainers' if c.init else 'containers'}{{{c.name}}}"
        self.k.events.emit(self.pod, type_, reason, message, field)

    # ---- sandbox ----------------------------------------------------------------------------
    def _pod_with_ips(self) -> dict:
        status = {**(self.pod.get("status") or {}), "hostIP": self.k.host_ip, "podIP": self.pod_ip}
        status["podIPs"] = [{"ip": self.pod_ip}] if self.pod_ip else []
        status["hostIPs"] = [{"ip": self.k.host_ip}]
        return {**self.pod, "status": status}

    def _create_sandbox(self) -> bool:
        """Network namespace and address, then volumes; False (with an Event) to retry later."""
        try:
            if self.pod["spec"].get("hostNetwork"):
                self.pod_ip = self.k.host_ip
            elif self.pod_ip is None:
                self.pod_ip = self.k.network.create(self.uid, (self.pod.get("status") or {}).get("podIP"))
        except Exception as err:  # noqa: BLE001 - reported as the kubelet does, then retried
            self._emit("Warning", "FailedCreatePodSandBox", f"Failed to create pod sandbox: {err}")
            return False
        self.write_hosts()
        try:
            self.volumes = volumes.prepare(self._pod_with_ips(), self.dir, self.k.state_dir, self.k.objects)
            self.volumes.update(volumes.token_fallback(self.pod, self.dir, self.k.objects, self.k.ca_pem))
        except volumes.MountError as err:
            self._emit("Warning", "FailedMount", str(err))
            return False
        self.sandbox_ready = True
        log.info("pod %s: sandbox ready, IP %s, logs under %s", self.key, self.pod_ip, self.dir)
        return True

    def _hosts_path(self) -> Path | None:
        """The pod's managed /etc/hosts; None for a hostNetwork pod (it sees the node's)."""
        return None if self.pod["spec"].get("hostNetwork") else self.dir / "hosts"

    def _resolv_path(self) -> Path | None:
        """The pod's /etc/resolv.conf when its DNS is the cluster's (names.cluster_first), written once."""
        if not names.cluster_first(self.pod):
            return None
        path = self.dir / "resolv.conf"
        if not path.exists():
            names.write_in_place(path, names.resolv_conf(self.pod["metadata"]["namespace"], self.k.host_ip))
        return path

    def write_hosts(self) -> None:
        """(Re)writes the pod's /etc/hosts from its IP and the current cluster-DNS records
        (names.hosts_file); called at sandbox creation and, from the EndpointSlice watch, on
        every change of the records. Under a lock, so the last writer wrote the latest records."""
        path = self._hosts_path()
        with self.hosts_lock:
            if path is None or self.pod_ip is None or self.hosts_closed:
                return
            try:
                names.write_in_place(path, names.hosts_file(self.pod, self.pod_ip, self.k.names.records))
            except OSError as err:
                log.warning("pod %s: hosts file not written: %s", self.key, err)

    # ---- containers -------------------------------------------------------------------------
    def _sync_containers(self) -> None:
        """Init containers in order (the next one starts once this one completed or, a sidecar,
        started), then the app containers; sidecars are restarted beside them; when no app
        container will run again (or initialization failed for good), the sidecars stop."""
        blocked = False
        for c in self.init:
            if self.init_failed or self.apps_done or (not c.sidecar and (self.initialized or self._completed(c))):
                continue
            if blocked:  # behind a sidecar that (re)starts: only an exit is noticed, nothing starts
                self._poll(c)
                continue
            self._step(c)
            blocked = not self.initialized and not (c.view.started if c.sidecar else self._completed(c))
        if not blocked and not self.init_failed:
            self.initialized = True
            for c in self.app:
                self._step(c)
        if self.init_failed or (self.initialized and all("terminated" in c.view.state for c in self.app)):
            self._stop_sidecars()

    @staticmethod
    def _completed(c: Container) -> bool:
        return c.proc is None and c.view.state.get("terminated", {}).get("exitCode") == 0

    def _stop_sidecars(self) -> None:
        """Stops the running sidecars once the pod's other containers are done (the kubelet's
        KillPod): reverse order, within the pod's grace period, and records their exits."""
        self.apps_done = True
        sidecars = [c for c in self.init if c.sidecar and c.proc is not None]
        if not sidecars:
            return
        began = time.monotonic()
        self._stop_all(self._grace_seconds(), run_prestop=True, only=sidecars)
        for c in sidecars:
            self._on_exit(c, c.proc.wait())
        log.info("pod %s: sidecars stopped in %.1f s", self.key, time.monotonic() - began)

    def _restart_policy(self) -> str:
        return self.pod["spec"].get("restartPolicy", "Always")

    def _should_restart(self, c: Container, exit_code: int) -> bool:
        policy = self._restart_policy()
        if c.sidecar:
            return not self.apps_done
        if c.init:
            return exit_code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and exit_code != 0)

    def _poll(self, c: Container) -> bool:
        """True while ``c`` runs; records its exit when it has just exited."""
        if c.proc is None:
            return False
        code = c.proc.poll()
        if code is None:
            return True
        self._on_exit(c, code)
        return False

    def _step(self, c: Container) -> None:
        if self._poll(c):
            return
        if "terminated" in c.view.state:
            return
        if time.monotonic() < c.next_start:
            return self._show_pull_backoff(c)
        self._start(c)

    def _on_exit(self, c: Container, code: int) -> None:
        c.probe_stop.set()
        c.signal(signal.SIGKILL)  # what is left of the container's process group goes with it
        exit_code = 128 - code if code < 0 else code
        term = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": c.view.state.get("running", {}).get("startedAt", rfc3339()),
                "finishedAt": rfc3339(), "containerID": c.view.container_id}
        if c.error_file().exists() and c.error_file().stat().st_size:
            term.update(exitCode=128, reason="StartError", message=c.error_file().read_text())
            self._emit("Warning", "Failed", f"Error: {term['message']}", c)
        else:
            message = self._termination_message(c, exit_code)
            if message:
                term["message"] = message
        c.proc, c.stopping = None, False
        c.view.ready = c.view.started = False
        log.info("pod %s: container %s exited with %s", self.key, c.name, exit_code)
        if c.init and not c.sidecar and exit_code != 0 and self._restart_policy() == "Never":
            self.init_failed = True
        if not self._should_restart(c, exit_code):
            c.view.state = {"terminated": term}
            return
        delay = self._restart_delay(c)
        c.next_start = time.monotonic() + delay
        c.view.last_state = {"terminated": term}
        c.view.state = {"waiting": {"reason": "CrashLoopBackOff", "message":
                        f"back-off {go_duration(delay)} restarting failed container={c.name} pod={self.key}"}}
        if delay:
            self._emit("Warning", "BackOff", f"Back-off restarting failed container {c.name} in pod {self.key}", c)

    def _termination_message(self, c: Container, exit_code: int) -> str:
        path = c.termination_log()
        message = path.read_bytes()[:4096].decode(errors="replace") if path.exists() else ""
        if not message and exit_code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            lines = c.log_path().read_bytes()[-2048:].decode(errors="replace").splitlines()[-80:]
            message = "\n".join(lines)
        return message

    def _restart_delay(self, c: Container) -> float:
        """0 for the first restart, then base, doubling to max (reset after a long run)."""
        if time.monotonic() - c.started_mono > 2 * self.k.backoff_max:
            c.backoff = 0.0
        delay = c.backoff
        c.backoff = self.k.backoff_base if delay == 0 else min(delay * 2, self.k.backoff_max)
        return delay

    def _show_pull_backoff(self, c: Container) -> None:
        waiting = c.view.state.get("waiting", {})
        failed_at = c.next_start - c.backoff
        if waiting.get("reason") == "ErrImagePull" and time.monotonic() - failed_at > 1:
            image = c.spec["image"]
            c.view.state = {"waiting": {"reason": "ImagePullBackOff",
                                        "message": f'Back-off pulling image "{image}": ErrImagePull: {waiting["message"]}'}}
            self._emit("Normal", "BackOff", f'Back-off pulling image "{image}"', c)
            self._emit("Warning", "Failed", "Error: ImagePullBackOff", c)

    def _start(self, c: Container) -> None:
        image_ref = c.spec["image"]
        try:
            image = resolve(image_ref, self.k.repo, self.k.state_dir,
                            c.spec.get("imagePullPolicy") or "IfNotPresent")
        except ImagePullError as err:
            c.pull_failures += 1
            c.backoff = min(self.k.backoff_base * 2 ** (c.pull_failures - 1), self.k.backoff_max)
            c.next_start = time.monotonic() + c.backoff
            c.view.state = {"waiting": {"reason": "ErrImagePull", "message": str(err)}}
            self._emit("Warning", "Failed", f'Failed to pull image "{image_ref}": {err}', c)
            self._emit("Warning", "Failed", "Error: ErrImagePull", c)
            return
        if c.pull_failures or c.spec.get("imagePullPolicy") == "Always":
            self._emit("Normal", "Pulling", f'Pulling image "{image_ref}"', c)
            self._emit("Normal", "Pulled", f'Successfully pulled image "{image_ref}" in 1ms (1ms including waiting). '
                       "Image size: 0 bytes.", c)
        else:
            self._emit("Normal", "Pulled", f'Container image "{image_ref}" already present on machine', c)
        c.pull_failures, c.image = 0, image
        try:
            c.user = resolve_user(self.pod, c.spec, image)
            c.env = container_env(self._pod_with_ips(), c.spec, image, self.k.service_env(), self.k.objects)
            argv = command_line(c.spec, image, c.env)
        except (StartRefused, ConfigError, LookupError) as err:
            c.next_start = time.monotonic() + self.k.backoff_base
            c.view.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            self._emit("Warning", "Failed", f"Error: {err}", c)
            return
        restart = c.view.restart_count + 1 if c.view.container_id else 0
        try:
            netns = None if self.pod["spec"].get("hostNetwork") else f"/var/run/netns/{self.k.network.netns(self.uid)}"
            launch = c.launch_spec(argv, restart, self.volumes, self.dir / ".home", netns,
                                   self.k.image_paths, self.k.exposed, self._hosts_path(), self._resolv_path(),
                                   None if self.pod["spec"].get("hostNetwork") else names.pod_hostname(self.pod))
        except ConfigError as err:
            c.next_start = time.monotonic() + self.k.backoff_base
            c.view.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(err)}}
            self._emit("Warning", "Failed", f"Error: {err}", c)
            return
        c.view.restart_count = restart
        c.start(launch)
        c.view.image_id = image.image_id
        c.view.state = {"running": {"startedAt": rfc3339()}}
        self._emit("Normal", "Created", f"Created container: {c.name}", c)
        self._emit("Normal", "Started", f"Started container {c.name}", c)
        log.info("pod %s: started %s (pid %s), log %s", self.key, c.name, c.proc.pid, c.log_path())
        self._start_probes(c)

    # ---- probes -----------------------------------------------------------------------------
    def _start_probes(self, c: Container) -> None:
        c.probe_stop, c.startup_done = threading.Event(), threading.Event()
        if not c.spec.get("startupProbe"):
            c.startup_done.set()
            c.view.started = True
            c.view.ready = not c.spec.get("readinessProbe")
        for kind, key in PROBES:
            spec = c.spec.get(key)
            if not spec:
                continue
            probe = partial(lambda spec, timeout: run_handler(spec, self.pod_ip, c.spec, c.exec, timeout), spec)
            wait_for = c.startup_done if kind != "Startup" and c.spec.get("startupProbe") else None
            ProbeWorker(kind, spec, probe, c.started_mono, partial(self._on_probe, c), wait_for, c.probe_stop).start()

    def _on_probe(self, c: Container, kind: str, what: str, message: str) -> None:
        if what == "failed":
            self._emit("Warning", "Unhealthy", f"{kind} probe failed: {message}", c)
        elif what == "healthy" and kind == "Startup":
            c.view.started = True
            c.startup_done.set()
            c.view.ready = not c.spec.get("readinessProbe")
        elif kind == "Readiness":
            c.view.ready = what == "healthy"
        elif what == "unhealthy" and not c.stopping:
            c.stopping = True
            self._emit("Normal", "Killing", f"Container {c.name} failed {kind.lower()} probe, will be restarted", c)
            probe_grace = c.spec[f"{kind.lower()}Probe"].get("terminationGracePeriodSeconds")
            grace = probe_grace if probe_grace is not None else self.pod["spec"].get("terminationGracePeriodSeconds", 30)
            threading.Thread(target=c.stop, args=(float(grace),), daemon=True).start()
        self.wake.set()

    # ---- status -----------------------------------------------------------------------------
    def _sync_status(self) -> None:
        """Patches the pod's status when it differs from what this worker last wrote."""
        pod = self.pod
        if self.last_status:  # our own last conditions, in case the watch has not caught up
            seen = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
            seen.update({c["type"]: c for c in self.last_status["conditions"] if c["type"] != "PodScheduled"})
            pod = {**pod, "status": {**(pod.get("status") or {}), "conditions": list(seen.values())}}
        status = pod_status(pod, pod_ip=self.pod_ip, host_ip=self.k.host_ip, start_time=self.start_time,
                            sandbox_ready=self.sandbox_ready, init=[c.view for c in self.init],
                            app=[c.view for c in self.app], init_failed=self.init_failed)
        if status["phase"] in ("Succeeded", "Failed") and not self.finished:
            self.finished = True
            self.k.network.delete(self.uid)
        if status == self.last_status:
            return
        meta = self.pod["metadata"]
        try:
            self.k.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status},
                                                    _preload_content=False)
            self.last_status = status
        except ApiException as err:
            if err.status == 404:
                self.gone = True
            else:
                log.warning("pod %s: status not written: %s %s", self.key, err.reason, err.body)

    # ---- stopping ---------------------------------------------------------------------------
    def _grace_seconds(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        return float(grace if grace is not None else spec.get("terminationGracePeriodSeconds", 30))

    def _terminate(self) -> None:
        """Deletion: each container's preStop hook, SIGTERM and SIGKILL within the grace period,
        then the pod object is removed (grace 0), which completes the delete."""
        log.info("pod %s: deleting (grace %.0f s)", self.key, self._grace_seconds())
        self._stop_all(self._grace_seconds(), run_prestop=True)
        self._teardown()
        meta = self.pod["metadata"]
        try:
            self.k.core.delete_namespaced_pod(meta["name"], meta["namespace"], _preload_content=False,
                                              body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiException as err:
            if err.status not in (404, 409):
                log.warning("pod %s: not deleted: %s", self.key, err.reason)

    def _stop_all(self, grace: float, run_prestop: bool, only: list[Container] | None = None) -> None:
        """Stops the running containers (``only`` these) at once, each within the grace period
        (seconds; the pod's, which may change, when ``run_prestop``), except that a sidecar gets
        its SIGTERM only once the app containers and the sidecars after it have exited (the
        kubelet's terminationOrdering)."""
        began = time.monotonic()

        def deadline() -> float:
            if self.gone:
                return time.monotonic()
            return began + (self._grace_seconds() if run_prestop else grace)

        sidecars = [c for c in self.init if c.sidecar]
        threads = []
        for c in only if only is not None else self.init + self.app:
            if c.proc is None or c.proc.poll() is not None:
                continue
            later = sidecars[next(i for i, s in enumerate(sidecars) if s is c) + 1:] if c.sidecar else []
            after = self.app + later if c.sidecar else []
            t = threading.Thread(target=self._stop_one, args=(c, deadline, run_prestop, after), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    def _stop_one(self, c: Container, deadline, run_prestop: bool, after: list[Container]) -> None:
        """preStop hook, then (once every container of ``after`` has exited, or at the deadline)
        SIGTERM, then SIGKILL at the deadline but never under MIN_GRACE_S after the SIGTERM."""
        c.probe_stop.set()
        self._emit("Normal", "Killing", f"Stopping container {c.name}", c)
        hook = ((c.spec.get("lifecycle") or {}).get("preStop")) if run_prestop and (not c.init or c.sidecar) else None
        if hook:
            ok, message = run_handler(hook, self.pod_ip, c.spec, c.exec, max(deadline() - time.monotonic(), 0.1))
            if not ok:
                self._emit("Warning", "FailedPreStopHook", f"PreStopHook failed: {message}", c)
        while time.monotonic() < deadline() and any(o.proc is not None and o.proc.poll() is None for o in after):
            time.sleep(0.1)
        term_at = time.monotonic()
        c.stop(max(deadline() - term_at, MIN_GRACE_S), deadline_fn=lambda: max(deadline(), term_at + MIN_GRACE_S))

    def _teardown(self) -> None:
        """Kills what is left, unmounts and removes the pod's directory, frees its address."""
        for c in self.init + self.app:
            c.probe_stop.set()
            if c.proc is not None and c.proc.poll() is None:
                c.signal(signal.SIGKILL)
                c.proc.wait()
        volumes.unmount_memory(self.dir)
        with self.hosts_lock:
            self.hosts_closed = True
        if not self.pod["spec"].get("hostNetwork"):
            self.k.network.delete(self.uid)
        if not self.shutdown:
            shutil.rmtree(self.dir, ignore_errors=True)
