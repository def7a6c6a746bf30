"""Processes that hold a lock or a lease: who this process is, and whether another one is gone."""
from __future__ import annotations

import os
import socket


def lease_holder() -> str:
    """This process as a lease holder: ``$HOSTNAME`` (the pod name in Kubernetes) and the pid."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}:{os.getpid()}"


def pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"); "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""


PIDNS = pid_namespace()


def gone(holder: str, pidns: str) -> bool:
    """Whether the process ``holder`` ("host:pid") is known to have exited: it ran on this host
    and in this pid namespace (``pidns`` as recorded) and no process has its pid now. Unknown
    (another host, another namespace, a record without ``pidns``): False."""
    host, _, pid = holder.rpartition(":")
    # isascii: str.isdigit accepts "²", which int() refuses
    if host != lease_holder().rpartition(":")[0] or not (pid.isascii() and pid.isdigit()) or not pidns \
            or pidns != PIDNS:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive, owned by someone else; or no pid at all
        return False
    return False
