"""Pod status from the kubelet's view of its containers: phase, conditions, container statuses.

Pure functions; the phase follows the kubelet's ``getPhase`` (a container waiting to restart
counts as stopped, not waiting), the conditions its status generator (PodReadyToStartContainers,
Initialized, ContainersReady, Ready; PodScheduled is the scheduler's and is kept as it is).
Native sidecars (init containers with ``restartPolicy: Always``, KEP-753) count as the kubelet
counts them: started, not completed, for Initialized; ready for ContainersReady and Ready; running
for the phase, and not at all once they stopped.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field


def rfc3339(t: float | None = None) -> str:
    stamp = dt.datetime.now(dt.timezone.utc) if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class ContainerView:
    """What the status needs of one container (``state``/``last_state`` as the API spells them)."""
    name: str
    image: str
    image_id: str = ""
    container_id: str = ""
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    sidecar: bool = False          # an init container with restartPolicy Always (not reported)

    def api(self) -> dict:
        out = {"name": self.name, "image": self.image, "imageID": self.image_id,
               "ready": self.ready, "started": self.started, "restartCount": self.restart_count,
               "state": self.state, "lastState": self.last_state}
        if self.container_id:
            out["containerID"] = self.container_id
        return out


def _exit(view: ContainerView) -> int | None:
    term = view.state.get("terminated")
    return None if term is None else term["exitCode"]


def app_started(app: list[ContainerView]) -> bool:
    """Whether an app container runs or ran (the kubelet's HasAnyRegularContainerStarted): the
    pod has been initialized, whatever its sidecars do since."""
    return any("running" in v.state or "terminated" in v.state for v in app)


def phase(restart_policy: str, init: list[ContainerView], app: list[ContainerView], init_failed: bool) -> str:
    """The pod phase (Pending, Running, Succeeded, Failed) as the kubelet's getPhase computes it:
    a sidecar not yet started keeps an uninitialized pod Pending, a running sidecar counts as a
    running container, a stopped (or restarting) one is left out."""
    if init_failed:
        return "Failed"
    if any(_exit(v) != 0 for v in init if not v.sidecar):
        return "Pending"
    running = waiting = stopped = succeeded = pending_sidecars = 0
    for v in init:
        if not v.sidecar:
            continue
        if "running" in v.state:
            running += 1
            pending_sidecars += not v.started
        elif "terminated" not in v.state and not v.last_state.get("terminated"):
            pending_sidecars += 1
            waiting += 1
    if pending_sidecars and not app_started(app):
        return "Pending"
    for v in app:
        if "running" in v.state:
            running += 1
        elif "terminated" in v.state:
            stopped += 1
            succeeded += _exit(v) == 0
        elif v.last_state.get("terminated"):
            stopped += 1  # waiting to restart
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never":
            return "Failed"
        return "Running"
    return "Pending"


def _condition(type_: str, ok: bool, previous: dict[str, dict], reason: str = "", message: str = "") -> dict:
    status = "True" if ok else "False"
    old = previous.get(type_)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else rfc3339()
    out = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": since}
    if not ok and reason:
        out.update(reason=reason, message=message)
    return out


def conditions(pod: dict, pod_phase: str, sandbox_ready: bool, init: list[ContainerView],
               app: list[ContainerView]) -> list[dict]:
    """The kubelet's pod conditions, keeping each lastTransitionTime while its status holds:
    Initialized once the regular init containers completed and the sidecars started (or an app
    container ran), ContainersReady and Ready once the sidecars and app containers are ready."""
    previous = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    incomplete = [] if app_started(app) else [
        v.name for v in init if (not v.started if v.sidecar else _exit(v) != 0)]
    unready = [v.name for v in init if v.sidecar and not v.ready] + [v.name for v in app if not v.ready]
    done = pod_phase in ("Succeeded", "Failed")
    ready_reason = "PodCompleted" if done else "ContainersNotReady"
    ready_message = "" if done else f"containers with unready status: [{' '.join(unready)}]"
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    gates_ok = all((previous.get(g) or {}).get("status") == "True" for g in gates)
    out = [
        _condition("PodReadyToStartContainers", sandbox_ready and not done, previous),
        _condition("Initialized", not incomplete, previous, "ContainersNotInitialized",
                   f"containers with incomplete status: [{' '.join(incomplete)}]"),
        _condition("Ready", not unready and not done and gates_ok, previous, ready_reason,
                   ready_message if gates_ok else "the status of pod readiness gate is not \"True\""),
        _condition("ContainersReady", not unready and not done, previous, ready_reason, ready_message),
    ]
    if "PodScheduled" in previous:
        out.append(previous["PodScheduled"])
    return out


def pod_status(pod: dict, *, pod_ip: str | None, host_ip: str, start_time: str, sandbox_ready: bool,
               init: list[ContainerView], app: list[ContainerView], init_failed: bool) -> dict:
    """The ``status`` the kubelet reports for ``pod``."""
    restart_policy = pod["spec"].get("restartPolicy", "Always")
    pod_phase = phase(restart_policy, init, app, init_failed)
    status = {"phase": pod_phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "startTime": start_time,
              "conditions": conditions(pod, pod_phase, sandbox_ready, init, app),
              "containerStatuses": [v.api() for v in app]}
    if init:
        status["initContainerStatuses"] = [v.api() for v in init]
    if pod_ip:
        status.update(podIP=pod_ip, podIPs=[{"ip": pod_ip}])
    return status
