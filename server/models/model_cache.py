"""A model cache that several processes share (pods on one ReadWriteMany volume): a lock with a
heartbeat per model, completion markers per fetched revision, and eviction by size.

Layout under the cache directory (the fetched files themselves live in ``hf/`` and ``s3/``)::

    .slipstream/locks/<name>.lock           {"holder": "host:pid", "token", "started", "heartbeat"}
    .slipstream/entries/<name>/<rev>.json   {"model", "requested", "revision", "path", "bytes",
                                             "completed", "last_used"}   (a complete copy)

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local disks and NFSv3+; ``flock``
is not reliable on every network filesystem). Its holder rewrites the heartbeat every
``heartbeat_s`` seconds from a thread. A waiter takes the lock over when it has seen the heartbeat
unchanged for ``stale_after_s`` seconds of its own clock, so clock skew between nodes does not
matter; a holder on the same host whose process is gone is stale at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger("slipstream.model_cache")

META_DIR = ".slipstream"
STALE_AFTER_S = 30.0
HEARTBEAT_S = 5.0


def cache_name(identity: str) -> str:
    """A file-system-safe name for a model identity (``hf://org/name@main:*.gguf``): readable
    prefix plus a hash, so two identities never share a lock or an entry folder."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", identity).strip("-")[:80]
    return f"{slug}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Entry:
    """One complete fetched copy. ``bytes``: size of its files; times: seconds since the epoch."""
    name: str
    model: str
    requested: str
    revision: str
    path: str
    bytes: int
    completed: float
    last_used: float


@dataclass
class Lock:
    """A held model lock. ``waited_since``: when this process began waiting for another holder
    (None if it took the lock at once); an entry completed after that was fetched by the other."""
    name: str
    token: str
    waited_since: float | None


class ModelCache:
    """Locks and completion markers under ``root`` (see the module docstring).

    Args:
        root: the model cache directory.
        stale_after_s: seconds of unchanged heartbeat after which a lock is taken over.
        heartbeat_s: seconds between a holder's heartbeat writes (well under ``stale_after_s``).
        poll_s: seconds between a waiter's looks at the lock.
    """

    def __init__(self, root: Path, *, stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S,
                 poll_s: float = 0.5):
        if heartbeat_s >= stale_after_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be less than stale_after_s ({stale_after_s})")
        self.root = Path(root)
        self.stale_after_s, self.heartbeat_s, self.poll_s = stale_after_s, heartbeat_s, poll_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}"

    # --- locks --------------------------------------------------------------------------

    def lock_path(self, name: str) -> Path:
        return self.root / META_DIR / "locks" / f"{name}.lock"

    @contextlib.contextmanager
    def lock(self, name: str, what: str = "") -> Iterator[Lock]:
        """Hold the lock ``name`` (waiting while another live process holds it), with a heartbeat
        thread, and release it on exit. ``what`` names the model in the waiting log line."""
        lock = self._acquire(name, what or name)
        stop = threading.Event()
        beat = threading.Thread(target=self._beat, args=(lock, stop), name=f"heartbeat {name}", daemon=True)
        beat.start()
        try:
            yield lock
        finally:
            stop.set()
            beat.join()
            self._release(lock)

    def _acquire(self, name: str, what: str) -> Lock:
        path = self.lock_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        waited_since = None
        seen: tuple[str, float] | None = None  # (content, monotonic time it was first seen)
        last_log = 0.0
        while True:
            now = time.time()
            record = {"holder": self.holder, "token": token, "started": now, "heartbeat": now}
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pass
            else:
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                return Lock(name, token, waited_since)
            content = _read_text(path)
            if content is None:  # released between our create and our read: try again at once
                continue
            if waited_since is None:
                waited_since = now
            if seen is None or seen[0] != content:
                seen = (content, time.monotonic())
            other = _parse(content)
            unchanged = time.monotonic() - seen[1]
            if unchanged >= self.stale_after_s or _dead_on_this_host(other.get("holder", "")):
                log.warning("taking over the lock of %s from %s (no heartbeat for %.0f s)", what,
                            other.get("holder", "?"), unchanged)
                self._break(path, content)
                seen = None
                continue
            if time.monotonic() - last_log >= 10.0:
                log.info("waiting for %s to download %s (heartbeat %.0f s ago)", other.get("holder", "?"), what,
                         unchanged)
                last_log = time.monotonic()
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
            if _read_text(path) == stale:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        finally:
            guard.unlink(missing_ok=True)

    def _beat(self, lock: Lock, stop: threading.Event) -> None:
        path = self.lock_path(lock.name)
        while not stop.wait(self.heartbeat_s):
            current = _parse(_read_text(path) or "")
            if current.get("token") != lock.token:
                log.warning("lost the lock %s to %s (heartbeat too late); going on", lock.name, current.get("holder"))
                return
            _write_atomic(path, json.dumps({**current, "heartbeat": time.time()}))

    def _release(self, lock: Lock) -> None:
        path = self.lock_path(lock.name)
        if _parse(_read_text(path) or "").get("token") == lock.token:
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

    # --- completion markers -------------------------------------------------------------

    def _entry_path(self, name: str, revision: str) -> Path:
        return self.root / META_DIR / "entries" / name / f"{cache_name(revision)}.json"

    def record(self, name: str, *, model: str, requested: str, revision: str, path: Path, nbytes: int) -> Entry:
        """Mark the copy at ``path`` complete (written last, after every file is in place)."""
        now = time.time()
        entry = Entry(name, model, requested, revision, str(Path(path).resolve()), nbytes, now, now)
        target = self._entry_path(name, revision)
        target.parent.mkdir(parents=True, exist_ok=True)
        # stored relative to the cache root: a cache copied, mounted elsewhere or named relatively still resolves
        _write_atomic(target, json.dumps({**asdict(entry), "path": self._relative(entry.path)}))
        return entry

    def _relative(self, path: str) -> str:
        try:
            return str(Path(path).relative_to(self.root.resolve()))
        except ValueError:
            return path

    def find(self, name: str, revision: str | None = None, *, completed_after: float | None = None) -> Entry | None:
        """The complete entry of ``name`` at ``revision`` (or, without one, the latest completed),
        if its files are still there; ``completed_after`` (epoch seconds) skips older ones."""
        found = [e for e in self.entries(name) if (revision is None or e.revision == revision)
                 and (completed_after is None or e.completed >= completed_after) and Path(e.path).exists()]
        return max(found, key=lambda e: e.completed, default=None)

    def entries(self, name: str | None = None) -> list[Entry]:
        """Complete entries, of one model or all; unreadable markers are skipped."""
        base = self.root / META_DIR / "entries"
        files = (base / name).glob("*.json") if name else base.glob("*/*.json")
        out = []
        root = self.root.resolve()
        for f in files:
            try:
                entry = Entry(**json.loads(f.read_text()))
            except (OSError, ValueError, TypeError):
                continue
            out.append(dataclasses.replace(entry, path=str(root / entry.path)))  # absolute stays absolute
        return out

    def touch(self, entry: Entry) -> Entry:
        """Record a use of ``entry`` now (eviction removes the least recently used first)."""
        used = Entry(**{**asdict(entry), "last_used": time.time()})
        with contextlib.suppress(OSError):
            _write_atomic(self._entry_path(entry.name, entry.revision),
                          json.dumps({**asdict(used), "path": self._relative(used.path)}))
        return used

    def remove(self, entry: Entry) -> None:
        """Delete the marker (first, so nobody reuses a half-deleted copy), then the files. A Hugging
        Face snapshot is removed with huggingface_hub's own cache tools, which keep blobs that other
        revisions still link to."""
        self._entry_path(entry.name, entry.revision).unlink(missing_ok=True)
        root = self.root.resolve()
        hf_root = root / "hf"
        path = Path(entry.path).resolve()
        if not path.is_relative_to(root) or path in (root, hf_root, root / "s3"):
            log.warning("not removing %s: outside the cache %s", path, root)
            return
        if path.is_relative_to(hf_root):
            if any(e.revision == entry.revision and Path(e.path).is_relative_to(hf_root) for e in self.entries()):
                return  # the snapshot also backs another entry (another file selector of the same commit)
            from huggingface_hub import scan_cache_dir

            scan_cache_dir(hf_root).delete_revisions(entry.revision).execute()
        elif not any(e.path == entry.path for e in self.entries()):
            folder = path.parent if path.is_file() else path  # a GGUF: its folder
            if folder.is_relative_to(root / "s3") and folder != root / "s3":
                shutil.rmtree(folder, ignore_errors=True)


def evict(cache_dir: Path, max_bytes: int, keep: tuple[str, ...] = (), cache: ModelCache | None = None) -> list[Entry]:
    """Remove least-recently-used complete entries until the entries add up to ``max_bytes`` or
    less. Entries whose model is locked (being fetched) and those whose name or path is in ``keep``
    are never removed. Returns the removed entries, oldest first.

    A serving process keeps no file open once its weights are loaded, so removing the copy of a
    running model does not disturb it; but a pod's server that restarts in place (its init
    container does not run again) finds its revision gone until the pod is recreated, so size
    ``max_bytes`` above the models in use."""
    cache = cache or ModelCache(cache_dir)
    kept = {str(Path(k).resolve()) for k in keep}
    entries = sorted(cache.entries(), key=lambda e: e.last_used)
    total = sum(e.bytes for e in entries)
    removed = []
    for e in entries:
        if total <= max_bytes:
            break
        if e.name in keep or e.path in kept or cache.is_locked(e.name):
            continue
        log.info("evicting %s at %s (%d bytes, last used %s)", e.model, e.revision, e.bytes,
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)))
        cache.remove(e)
        total -= e.bytes
        removed.append(e)
    return removed


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _parse(content: str) -> dict:
    try:
        value = json.loads(content)
    except ValueError:  # a lock being written: treat as a live holder we know nothing about
        return {}
    return value if isinstance(value, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dead_on_this_host(holder: str) -> bool:
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return False
