"""How many CPUs this process may really use, and so how many torch threads to run.

``os.cpu_count()`` (and torch's default thread count) sees the whole node: a pod limited to 2
CPUs on a 64-core node would run 64 OpenMP threads that spin and get throttled. The real budget
is the cgroup CPU quota (a pod's ``resources.limits.cpu``) and the scheduler affinity mask
(``taskset``, cpusets), whichever is smaller.

The other half is where the threads live. GNU OpenMP (``libgomp``, torch's on PyPI) keeps a team
of worker threads for every thread that ever ran a parallel region, and once the process holds
more such workers than CPUs it stops spinning at its barriers: every parallel region then pays a
futex wake-up. The engine loads on one thread and steps on another, so :func:`release_openmp_team`
lets the loading thread give its team back.
"""
from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path


def _quota_cpus(quota: int, period: int) -> int | None:
    """CPUs of a CFS quota (µs per period µs), rounded up, at least 1; None for no quota."""
    if quota <= 0 or period <= 0:  # cgroup v1 writes -1 for no quota
        return None
    return max(1, math.ceil(quota / period))


def cgroup_cpus(root: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """CPUs the cgroup quota allows, or None when there is no quota or it cannot be read.

    Reads cgroup v2 ``<root>/cpu.max`` (``"max 100000"``: no quota; ``"200000 100000"``: 2),
    else cgroup v1 ``<root>/cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` (quota -1: no
    quota). A fractional quota rounds up (1.5 CPUs → 2). Never raises.
    """
    root = Path(root)
    try:
        quota, period = (root / "cpu.max").read_text().split()
        return None if quota == "max" else _quota_cpus(int(quota), int(period))
    except (OSError, ValueError):
        pass
    for controller in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / controller / "cpu.cfs_quota_us").read_text())
            period = int((root / controller / "cpu.cfs_period_us").read_text())
            return _quota_cpus(quota, period)
        except (OSError, ValueError):
            continue
    return None


def affinity_cpus() -> int | None:
    """CPUs in this process's scheduler affinity mask, or None where the OS does not say."""
    try:
        return len(os.sched_getaffinity(0)) or None
    except (AttributeError, OSError):  # not Linux
        return None


def cpu_limit(root: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """CPUs this process may use: the smaller of the cgroup quota (:func:`cgroup_cpus`) and the
    affinity mask (:func:`affinity_cpus`); None when neither is known."""
    known = [n for n in (cgroup_cpus(root), affinity_cpus()) if n is not None]
    return min(known) if known else None


def choose_threads(configured: int | None, torch_default: int, limit: int | None) -> tuple[int, str]:
    """The torch intra-op thread count and why it was chosen.

    Args:
        configured: ``EngineConfig.num_threads``; when set it wins.
        torch_default: ``torch.get_num_threads()`` before any setting.
        limit: :func:`cpu_limit`.
    """
    if configured:
        return configured, "set by num_threads"
    if limit is not None and limit < torch_default:
        return limit, f"the CPU limit (cgroup quota, affinity mask) is {limit}; torch's default was {torch_default}"
    return torch_default, f"torch's default; the CPU limit is {limit if limit is not None else 'unknown'}"


def release_openmp_team() -> bool:
    """Release the calling thread's idle OpenMP worker threads (``omp_pause_resource_all``,
    OpenMP 5.0); its next parallel region starts a new team. Call it on a thread that is done
    with torch work, e.g. after loading a model that another thread will run.

    Why: libgomp throttles its barrier spin to ~100 iterations while it manages more threads
    than there are CPUs, so with a team left on the loading thread every parallel region of the
    stepping thread sleeps and wakes (measured here at 2 threads: a one-row Q4_1 product of
    576 x 3072 took 85 µs instead of 42, a one-row decode step 26 ms instead of 18).

    Returns True when a team was released or there was none; False where the process has no
    libgomp loaded (another OpenMP runtime, or none) or it refused (called inside a parallel
    region). Never raises.
    """
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):  # not loaded here, or older than OpenMP 5.0
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # omp_pause_soft; libgomp treats soft and hard alike
