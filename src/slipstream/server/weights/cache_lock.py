"""The model cache's lock: one fetch of a model at a time across processes and nodes.


The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local disks and NFSv3+; ``flock``
is not reliable on every network filesystem). Its holder rewrites the heartbeat every
``heartbeat_s`` seconds from a thread. A waiter takes the lock over when it has seen the heartbeat
unchanged for ``stale_after_s`` seconds of its own clock, so clock skew between nodes does not
matter; a holder on the same host whose process is gone is stale at once (same host name and
pid namespace, ``pidns``: pods with ``hostNetwork`` share the node's name, not its pids).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .cache_files import META_DIR, parse_json, read_text
from .disk_cache import write_atomic
from .holders import PIDNS, gone

log = logging.getLogger("slipstream.model_cache")

STALE_AFTER_S = 30.0
HEARTBEAT_S = 5.0


@dataclass
class Lock:
    """A held model lock. ``waited_since``: when this process began waiting for another holder
    (None if it took the lock at once); an entry completed after that was fetched by the other."""
    name: str
    token: str
    waited_since: float | None


class CacheLocks:
    """The lock half of :class:`~.cache.ModelCache`: it needs ``root`` (the cache directory),
    ``holder`` (:func:`.holders.lease_holder`), ``stale_after_s``, ``heartbeat_s`` and ``poll_s``."""

    root: Path
    holder: str
    stale_after_s: float
    heartbeat_s: float
    poll_s: float

    def lock_path(self, name: str) -> Path:
        return self.root / META_DIR / "locks" / f"{name}.lock"

    @contextlib.contextmanager
    def lock(self, name: str, what: str = "", *, writes: Iterable[str] = (),
             check: Callable[[], None] | None = None) -> Iterator[Lock]:
        """Hold the lock ``name`` (waiting while another live process holds it), with a heartbeat
        thread, and release it on exit (also when the body raises).

        Args:
            what: names the model in the waiting log line.
            writes: folders, relative to the cache root, that the holder writes partial files in;
                :func:`.eviction.evict` leaves partial files there alone while the lock is live.
            check: called between looks at another process's lock; what it raises (a fetch being
                cancelled) ends the wait.
        """
        lock = self._acquire(name, what or name, list(writes), check)
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(lock, stop), name=f"heartbeat {name}", daemon=True)
        beat.start()
        try:
            yield lock
        finally:
            stop.set()
            beat.join()
            self._release(lock)

    def _acquire(self, name: str, what: str, writes: list[str], check: Callable[[], None] | None) -> Lock:
        path = self.lock_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        waited_since = None
        seen: tuple[str, float] | None = None  # (content, monotonic time it was first seen)
        last_log = 0.0
        while True:
            now = time.time()
            record = {"holder": self.holder, "pidns": PIDNS, "token": token, "started": now, "heartbeat": now, "model": what,
                      "writes": writes}
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                return Lock(name, token, waited_since)
            content = read_text(path)
            if content is None:  # released between our create and our read: try again at once
                continue
            if waited_since is None:
                waited_since = now
            if seen is None or seen[0] != content:
                seen = (content, time.monotonic())
            other = parse_json(content)
            unchanged = time.monotonic() - seen[1]
            if unchanged >= self.stale_after_s or gone(str(other.get("holder", "")), str(other.get("pidns", ""))):
                log.warning("taking over the lock of %s from %s (no heartbeat for %.0f s, or no such process)", what,
                            other.get("holder", "?"), unchanged)
                self._break(path, content)
                seen = None
                continue
            if time.monotonic() - last_log >= 10.0:
                log.info("waiting for %s, which holds the lock of %s (heartbeat %.0f s ago)", other.get("holder", "?"),
                         what, unchanged)
                last_log = time.monotonic()
            if check is not None:
                check()
            time.sleep(self.poll_s)

    def _break(self, path: Path, stale: str) -> None:
        """Remove the lock at ``path`` if it still holds ``stale``; a guard file keeps two waiters from
        both breaking it (the second would remove the first one's fresh lock)."""
        guard = path.with_suffix(".takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            # a guard left by a process that died mid-takeover (it is held for microseconds)
            with contextlib.suppress(OSError):
                if time.time() - guard.stat().st_mtime > self.stale_after_s:
                    guard.unlink()
            return
        os.close(fd)
        try:
            if read_text(path) == stale:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        finally:
            guard.unlink(missing_ok=True)

    def _beat(self, lock: Lock, stop: threading.Event) -> None:
        path = self.lock_path(lock.name)
        while not stop.wait(self.heartbeat_s):
            current = parse_json(read_text(path) or "")
            if current.get("token") != lock.token:
                log.warning("lost the lock %s to %s (heartbeat too late); going on", lock.name, current.get("holder"))
                return
            write_atomic(path, json.dumps({**current, "heartbeat": time.time()}))

    def _release(self, lock: Lock) -> None:
        path = self.lock_path(lock.name)
        if parse_json(read_text(path) or "").get("token") == lock.token:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def is_locked(self, name: str) -> bool:
        """Whether a live process holds ``name`` (heartbeat within ``stale_after_s`` by the file's
        mtime, which the file server sets)."""
        try:
            age = time.time() - self.lock_path(name).stat().st_mtime
        except FileNotFoundError:
            return False
        return age < self.stale_after_s

    def writing(self, now: float | None = None) -> list[str] | None:
        """The folders (relative to the root) that live lock holders write partial files in; None
        when a live lock does not say (written by an older version: it may write anywhere). Live:
        as in :meth:`is_locked`."""
        now = time.time() if now is None else now
        folders: list[str] = []
        for path in (self.root / META_DIR / "locks").glob("*.lock"):
            try:
                if now - path.stat().st_mtime >= self.stale_after_s:
                    continue
            except FileNotFoundError:
                continue
            writes = parse_json(read_text(path) or "").get("writes")
            if not isinstance(writes, list):
                return None
            folders += [str(w) for w in writes]
        return folders
