"""In-use leases on the model cache's entries: a process that serves a copy keeps it from eviction.

A lease is held for the life of a process that serves from an entry (:meth:`CacheLeases.lease`,
taken by :func:`.fetch.fetch`): a daemon thread rewrites it every ``LEASE_HEARTBEAT_S`` seconds
and it is removed at a clean exit. :func:`.eviction.evict` never removes an entry with a live lease, one
rewritten within ``LEASE_STALE_AFTER_S`` seconds whose holder is not known to be gone (a pod
that died without cleanup stops pinning its entry after that long; a process on this host and
pid namespace, at once). A server restarted in place, which does not rerun its init
container, so finds its revision still there.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .cache_files import META_DIR, relative_path
from .disk_cache import write_atomic
from .holders import PIDNS, lease_holder

log = logging.getLogger("slipstream.model_cache")

# Leases only delay eviction when stale, so their limit is generous: it absorbs clock skew between the
# file server and the evicting node, and a file server that is slow for minutes.
LEASE_HEARTBEAT_S = 30.0
LEASE_STALE_AFTER_S = 300.0


@dataclass(frozen=True)
class LeaseRecord:
    """A lease as read back: ``path`` absolute; ``heartbeat`` epoch seconds; ``file`` its lease
    file; ``pidns`` the holder's pid namespace ("" if unknown)."""
    holder: str
    name: str
    revision: str
    path: str
    heartbeat: float
    file: str = ""
    pidns: str = ""


class Lease:
    """This process's lease on one entry (:meth:`CacheLeases.lease`)."""

    def __init__(self, file: Path, record: dict):
        self.file, self.record = file, record

    def beat(self) -> None:
        """Rewrite the lease with the time now (recreating it if a stale-lease sweep removed it);
        nothing when the cache folder itself is gone."""
        if not self.file.parent.is_dir():
            return
        self.record = {**self.record, "heartbeat": time.time()}
        try:
            write_atomic(self.file, json.dumps(self.record))
        except OSError as e:  # the next beat tries again; a lease only goes stale after many misses
            log.debug("lease heartbeat %s: %s", self.file, e)

    def release(self) -> None:
        """End the lease (idempotent): the entry may be evicted once no other process holds one."""
        with _LEASES_GUARD:
            _LEASES.pop(str(self.file), None)
        with contextlib.suppress(OSError):
            self.file.unlink()


_LEASES: dict[str, Lease] = {}
_LEASES_GUARD = threading.Lock()
_lease_thread: threading.Thread | None = None


def _start_lease_heartbeat() -> None:
    global _lease_thread
    if _lease_thread is not None and _lease_thread.is_alive():
        return
    _lease_thread = threading.Thread(target=_lease_heartbeats, name="lease heartbeat", daemon=True)
    _lease_thread.start()


def _lease_heartbeats() -> None:
    while True:
        time.sleep(LEASE_HEARTBEAT_S)
        with _LEASES_GUARD:
            held = list(_LEASES.values())
        for lease in held:
            lease.beat()


@atexit.register
def release_leases() -> None:
    """Release every lease this process holds (run at a clean exit)."""
    with _LEASES_GUARD:
        held = list(_LEASES.values())
    for lease in held:
        lease.release()


def live_leases(leases: Iterable[LeaseRecord], now: float, stale_after: float,
                is_gone: Callable[[str, str], bool] = lambda holder, pidns: False) -> list[LeaseRecord]:
    """The leases whose heartbeat (epoch seconds) is less than ``stale_after`` seconds from
    ``now`` and whose holder is not ``is_gone(holder, pidns)`` (:func:`gone` for this host); the
    others belong to processes that died without cleaning up. A heartbeat further ahead than
    ``stale_after`` (no clock is that far off) or not finite is no heartbeat: it never pins."""
    return [lease for lease in leases
            if abs(now - lease.heartbeat) < stale_after and not is_gone(lease.holder, lease.pidns)]


class CacheLeases:
    """The lease half of :class:`~.cache.ModelCache`: it needs ``root``, the cache directory."""

    root: Path

    def lease(self, name: str, revision: str, path: Path) -> Lease:
        """Record that this process serves the entry ``name`` at ``revision`` (files at ``path``)
        and keep the record fresh from a daemon thread until :meth:`Lease.release` or the
        process's exit; the same lease again if this process already holds it.

        Raises:
            OSError: the lease file cannot be written (a read-only cache: nothing can evict it).
        """
        holder = lease_holder()
        key = hashlib.sha256(f"{name}\n{revision}".encode()).hexdigest()[:16]
        file = self.root / META_DIR / "leases" / f"{key}.{re.sub(r'[^A-Za-z0-9._-]+', '-', holder)}.json"
        with _LEASES_GUARD:
            held = _LEASES.get(str(file))
            if held is not None:
                return held
            now = time.time()
            held = Lease(file, {"holder": holder, "pidns": PIDNS, "name": name, "revision": revision,
                                "path": relative_path(self.root, str(Path(path).resolve())), "started": now,
                                "heartbeat": now})
            file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(file, json.dumps(held.record))
            _LEASES[str(file)] = held
            _start_lease_heartbeat()
        return held

    def leases(self) -> list[LeaseRecord]:
        """Every lease file under the root, live or not (see :func:`live_leases`); ``heartbeat`` is
        the later of the recorded time and the file's mtime, so neither clock alone ends a lease."""
        out = []
        root = self.root.resolve()
        for f in (self.root / META_DIR / "leases").glob("*.json"):
            try:
                mtime = f.stat().st_mtime
                text = f.read_text()
            except OSError:
                continue  # removed meanwhile
            try:
                doc = json.loads(text)
                out.append(LeaseRecord(str(doc["holder"]), str(doc["name"]), str(doc["revision"]),
                                       str(root / doc["path"]), max(float(doc.get("heartbeat", 0)), mtime), str(f),
                                       str(doc.get("pidns", ""))))
            except (ValueError, TypeError, KeyError, AttributeError):
                # not a lease we can read (written whole, by write_atomic): it pins nothing and is
                # swept like a stale lease once its mtime is old
                out.append(LeaseRecord("unknown", "", "", "", mtime, str(f)))
        return out
