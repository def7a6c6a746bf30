"""One container of a pod: its process (started by launcher.py), its user, its exec sessions.

The process is the launcher's PID (the launcher execs the command), leader of its own process
group, so a stop signals the container's whole group, as a runtime signals its PID namespace.
A ``pid`` file (PID and start time) lets the next kubelet kill what this one left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .env import ConfigError, expand
from .images import Image
from .launcher import setpriv_args
from .status import ContainerView
from .volumes import TOKEN_DIR, TOKEN_FALLBACK, HostVolume

LAUNCHER = Path(__file__).with_name("launcher.py")
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"


class StartRefused(Exception):
    """The container cannot be created (CreateContainerConfigError), e.g. runAsNonRoot with root."""


@dataclass(slots=True)
class User:
    uid: int
    gid: int
    groups: list[int]
    no_new_privs: bool
    drop_all_caps: bool

    def setpriv(self) -> list[str]:
        return setpriv_args({"uid": self.uid, "gid": self.gid, "groups": self.groups,
                             "no_new_privs": self.no_new_privs, "drop_all_caps": self.drop_all_caps})


def resolve_user(pod: dict, container: dict, image: Image) -> User:
    """The process's identity from the pod's and the container's securityContext, else the
    image's USER; raises StartRefused when runAsNonRoot cannot hold (the kubelet's messages)."""
    psc = pod["spec"].get("securityContext") or {}
    csc = container.get("securityContext") or {}
    meta = pod["metadata"]
    explicit = csc.get("runAsUser", psc.get("runAsUser"))
    uid = image.uid if explicit is None else explicit
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    if gid is None:
        gid = image.gid if uid == image.uid else 0
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0:
        where = f'(pod: "{meta["name"]}_{meta["namespace"]}({meta["uid"]})", container: {container["name"]})'
        if explicit is None:
            raise StartRefused(f"container has runAsNonRoot and image will run as root {where}")
        raise StartRefused(f"container's runAsUser breaks non-root policy {where}")
    groups = list(psc.get("supplementalGroups") or [])
    if psc.get("fsGroup") is not None:
        groups.append(psc["fsGroup"])
    drops = [c.upper() for c in (csc.get("capabilities") or {}).get("drop") or []]
    return User(uid, gid, groups, csc.get("allowPrivilegeEscalation") is False, "ALL" in drops)


@dataclass
class Container:
    """The kubelet's record of one container across its restarts."""
    spec: dict
    init: bool
    dir: Path                                  # <pod dir>/<container name>
    view: ContainerView = None                 # what the status reports
    image: Image | None = None
    user: User | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    started_mono: float = 0.0
    next_start: float = 0.0                    # monotonic; back-off gate
    backoff: float = 0.0                       # seconds before the next restart
    pull_failures: int = 0
    stopping: bool = False                     # a stop (liveness, deletion) is under way
    kill_message: str = ""                     # why it was stopped, for the status
    probe_stop: threading.Event = field(default_factory=threading.Event)
    startup_done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        if self.view is None:
            self.view = ContainerView(self.spec["name"], self.spec.get("image", ""), sidecar=self.sidecar)
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def sidecar(self) -> bool:
        """A native sidecar (KEP-753): an init container with ``restartPolicy: Always``."""
        return self.init and self.spec.get("restartPolicy") == "Always"

    def log_path(self) -> Path:
        return self.dir / f"{self.view.restart_count}.log"

    def start(self, launch: dict) -> None:
        """Starts the process from a launcher spec (mounts, user, env, argv; see launcher.py)."""
        spec_file = self.dir / "launch.json"
        spec_file.touch(mode=0o600)  # it holds the container's environment, Secrets included
        spec_file.write_text(json.dumps({**launch, "error_file": str(self.error_file())}))
        with open(self.log_path(), "ab") as logf:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(LAUNCHER), str(spec_file)],
                                         stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                         start_new_session=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        self.started_mono = time.monotonic()
        (self.dir / "pid").write_text(f"{self.proc.pid} {process_start_time(self.proc.pid)}\n")
        self.view.container_id = f"process://{uuid.uuid4().hex}"

    def launch_spec(self, argv: list[str], restart: int, volumes: dict[str, HostVolume], home: Path,
                    netns: str | None, image_paths: list[Path], exposed: list[dict],
                    hosts: Path | None = None, resolv: Path | None = None,
                    hostname: str | None = None) -> dict:
        """The launcher's input for run ``restart``: namespaces (``hostname``: a UTS namespace
        with that name), mounts (volumes, the image's HOME, a pulled image's own top-level
        directories, the termination log, ``hosts`` at /etc/hosts and ``resolv`` at
        /etc/resolv.conf unless a volume is there), the paths the
        image runs from (``keep``: bound again inside any mount that covers them, e.g. a checkout
        under /tmp), user, working directory, env and argv. Raises ConfigError when a mountPath
        is exactly such a path."""
        mounts = []
        for vm in self.spec.get("volumeMounts") or []:
            vol = volumes[vm["name"]]
            source = vol.path
            sub = vm.get("subPath") or expand(vm.get("subPathExpr") or "", self.env)
            if sub:
                source = vol.path / sub
                if not source.exists():
                    source.mkdir(parents=True, mode=0o777)
            mounts.append({"source": str(source), "target": vm["mountPath"],
                           "read_only": bool(vm.get("readOnly")) or vol.read_only})
        targets = {m["target"].rstrip("/") for m in mounts}
        for target in targets:
            if Path(target) in image_paths:
                raise ConfigError(f"mountPath {target} is where the process kubelet's images run from "
                                  "(containers share the host's filesystem): choose another path")
        if self.image.home and self.image.home not in targets:
            home.mkdir(exist_ok=True)
            os.chown(home, self.user.uid, self.user.gid)
            mounts.append({"source": str(home), "target": self.image.home})
        for source in image_dirs(self.image):
            if f"/{source.name}" not in targets:
                mounts.append({"source": str(source), "target": f"/{source.name}", "read_only": True})
        if TOKEN_FALLBACK in volumes:
            mounts.append({"source": str(volumes[TOKEN_FALLBACK].path), "target": TOKEN_DIR, "read_only": True})
        term_log = self.termination_log(restart)
        term_log.touch()
        term_log.chmod(0o666)
        mounts.append({"source": str(term_log), "target": self.spec.get("terminationMessagePath") or "/dev/termination-log"})
        for source, target in ((hosts, "/etc/hosts"), (resolv, "/etc/resolv.conf")):
            if source is not None and target not in targets:
                mounts.append({"source": str(source), "target": target})
        return {"netns": netns, "hostname": hostname, "expose": exposed if self.user.uid != 0 else [], "mounts": mounts,
                "keep": [str(p) for p in image_paths],
                "uid": self.user.uid, "gid": self.user.gid, "groups": self.user.groups,
                "no_new_privs": self.user.no_new_privs, "drop_all_caps": self.user.drop_all_caps,
                "workdir": self.spec.get("workingDir") or self.image.workdir, "env": self.env, "argv": argv}

    def error_file(self) -> Path:
        return self.dir / "start-error"

    def termination_log(self, restart: int | None = None) -> Path:
        """The host file bound at terminationMessagePath for run ``restart`` (default: current)."""
        return self.dir / f"{self.view.restart_count if restart is None else restart}.termination-log"

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float, deadline_fn=None) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (``deadline_fn()`` may shorten it)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while proc.poll() is None:
            if deadline_fn is not None:
                deadline = min(deadline, deadline_fn())
            if time.monotonic() >= deadline:
                self.signal(signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.1)

    def exec(self, argv: list[str], timeout: float) -> tuple[int | None, str]:
        """Runs ``argv`` in the container's namespaces as its user (exec probes and hooks):
        (exit code or None on timeout, combined output)."""
        if self.proc is None or self.proc.poll() is not None:
            return 1, "container is not running"
        cmd = [NSENTER, "-t", str(self.proc.pid), "-m", "-n", "-u", "--", *self.user.setpriv(), *argv]
        try:
            done = subprocess.run(cmd, env=self.env, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, ""
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")


def image_dirs(image: Image) -> list[Path]:
    """The top-level directories of a pulled image's files (``image.files``) that the host lacks
    (absent, or an empty directory such as an earlier container's mount point): each is bound
    read-only at ``/<name>`` in the container, beside the host's tools. [] for table images."""
    if image.files is None:
        return []
    out = []
    for entry in sorted(image.files.iterdir()):
        host = Path("/") / entry.name
        host_lacks = not os.path.lexists(host) or (host.is_dir() and not host.is_symlink() and not any(host.iterdir()))
        if entry.is_dir() and not entry.is_symlink() and host_lacks:
            out.append(entry)
    return out


def process_start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or ''."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def kill_leftovers(pods_dir: Path) -> int:
    """Kills the process group of every container an earlier kubelet recorded (same PID and
    start time only, so a reused PID is left alone); returns how many."""
    killed = 0
    for pid_file in pods_dir.glob("*/*/pid"):
        try:
            pid_s, started = (pid_file.read_text().split() + [""])[:2]
            pid = int(pid_s)
        except (OSError, ValueError):
            continue
        if started and process_start_time(pid) == started:
            try:
                os.killpg(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed
