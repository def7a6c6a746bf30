"""The Pod Security Standards' ``restricted`` profile (the ``baseline`` checks included) as a
pure check of a pod spec, as the PodSecurity admission plugin applies it at ``latest``
(https://kubernetes.io/docs/concepts/security/pod-security-standards/). The real-cluster tests
put a namespace at ``pod-security.kubernetes.io/enforce: restricted``; this is the fast check.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

# Volume types restricted allows (hostPath and the in-tree drivers are refused).
ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                   "persistentVolumeClaim", "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(key) or ()


def restricted_violations(pod: Mapping[str, Any]) -> list[str]:
    """What the ``restricted`` profile refuses in pod spec ``pod`` (a PodSpec dict), one line
    each; [] when it is admitted."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = list(_containers(pod))
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} must be unset or false")
    if psc.get("windowsOptions", {}).get("hostProcess"):
        out.append("hostProcess must be unset or false")
    for volume in pod.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {volume.get('name')} has type {sorted(kinds)}")
    for sysctl in psc.get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {sysctl.get('name')} is not a safe one")
    for context in [psc] + [c.get("securityContext") or {} for c in containers]:
        selinux = context.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or \
                selinux.get("role"):
            out.append(f"seLinuxOptions {selinux} are not allowed")
        apparmor = (context.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"appArmorProfile type {apparmor} is not allowed")
        if context.get("runAsUser") == 0:
            out.append("runAsUser must not be 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    pod_non_root = psc.get("runAsNonRoot")
    for c in containers:
        name, sc = c.get("name"), c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"container {name}: privileged")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"container {name}: procMount {sc['procMount']}")
        for port in c.get("ports") or ():
            if port.get("hostPort"):
                out.append(f"container {name}: hostPort {port['hostPort']}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"container {name}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            out.append(f"container {name}: capabilities must drop ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            out.append(f"container {name}: adds capabilities {caps['add']}")
        non_root = sc.get("runAsNonRoot", pod_non_root)
        if non_root is not True:
            out.append(f"container {name}: runAsNonRoot must be true (pod or container)")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"container {name}: seccompProfile must be RuntimeDefault or Localhost")
    return out
