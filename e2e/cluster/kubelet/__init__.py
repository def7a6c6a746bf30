"""The process kubelet: pods bound to its Node run as local processes, each pod in its own
network namespace (an address on a bridge) and each container in its own mount namespace.
Run it with ``e2e/cluster/kubelet.py`` (see ``main.py`` for the flags).

| module | concept |
| --- | --- |
| ``main`` | CLI, start-up and shutdown, the pod watch, one worker per pod |
| ``node`` | the Node, its Ready condition and its Lease |
| ``worker`` | one pod's life: sandbox, init containers and native sidecars, app containers, restarts, probes, status, deletion (sidecars last) |
| ``container`` | one container's process, user, mounts (a pulled image's own directories too), exec sessions |
| ``launcher`` | the program that enters the pod's namespaces, mounts volumes and execs a container |
| ``status`` | phase, conditions and container statuses, sidecars included (pure) |
| ``env`` | environment, downward API and ``$(VAR)`` expansion (pure) |
| ``images`` | the image table (this repository's images, busybox/python) and images pulled from loopback registries (model images) |
| ``volumes`` | emptyDir, configMap, secret, downwardAPI, projected, PVC, hostPath, image; the pulled-image cache |
| ``network`` | bridge, network namespaces, addresses, the API server relay |
| ``names`` | a pod's hostname and managed /etc/hosts, with the headless Services' pod records cluster DNS would serve |
| ``probes`` | startup/readiness/liveness probes and lifecycle handlers |
| ``events`` | Events, aggregated as the kubelet's recorder does |
"""
from __future__ import annotations

from pathlib import Path


def pod_log_path(state_dir: str | Path, namespace: str, name: str, uid: str, container: str,
                 restart: int = 0) -> Path:
    """The file holding stdout and stderr of ``container``'s run number ``restart`` (0 for the
    first start, the restartCount after) of pod ``namespace/name`` with ``uid``."""
    return Path(state_dir) / "pods" / f"{namespace}_{name}_{uid}" / container / f"{restart}.log"
