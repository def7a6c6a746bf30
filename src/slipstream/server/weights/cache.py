"""A model cache that several processes share (pods on one ReadWriteMany volume): a lock with a
heartbeat per model, completion markers per fetched revision, in-use leases, and eviction by size.

Layout under the cache directory (the fetched files themselves live in ``hf/`` and ``s3/``)::

    .slipstream/locks/<name>.lock           {"holder": "host:pid", "pidns", "token", "started", "heartbeat",
                                             "model", "writes": [folders the download writes, relative]}
    .slipstream/entries/<name>/<rev>.json   {"model", "requested", "revision", "path", "bytes",
                                             "completed", "last_used"}   (a complete copy)
    .slipstream/leases/<key>.<holder>.json  {"holder", "pidns", "name", "revision", "path", "started",
                                             "heartbeat"}
                                             (a process serving that copy)

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local disks and NFSv3+; ``flock``
is not reliable on every network filesystem). Its holder rewrites the heartbeat every
``heartbeat_s`` seconds from a thread. A waiter takes the lock over when it has seen the heartbeat
unchanged for ``stale_after_s`` seconds of its own clock, so clock skew between nodes does not
matter; a holder on the same host whose process is gone is stale at once (same host name and
pid namespace, ``pidns``: pods with ``hostNetwork`` share the node's name, not its pids).

A lease is held for the life of a process that serves from an entry (:meth:`ModelCache.lease`,
taken by :func:`.fetch.fetch`): a daemon thread rewrites it every ``LEASE_HEARTBEAT_S`` seconds
and it is removed at a clean exit. :func:`evict` never removes an entry with a live lease, one
rewritten within ``LEASE_STALE_AFTER_S`` seconds whose holder is not known to be gone (a pod
that died without cleanup stops pinning its entry after that long; a process on this host and
pid namespace, at once). A server restarted in place, which does not rerun its init
container, so finds its revision still there.
"""
from __future__ import annotations

import atexit
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
from typing import Callable, Iterable, Iterator

from .disk_cache import stray_temporaries, write_atomic

log = logging.getLogger("slipstream.model_cache")

META_DIR = ".slipstream"
HF_DIR = "hf"  # huggingface_hub's cache_dir for Hub models, under the cache root
# The lock that evictions take, one at a time: cache_name() never makes a name that starts with a dot.
EVICT_LOCK = ".evict"
STALE_AFTER_S = 30.0
HEARTBEAT_S = 5.0
# Leases only delay eviction when stale, so their limit is generous: it absorbs clock skew between the
# file server and the evicting node, and a file server that is slow for minutes.
LEASE_HEARTBEAT_S = 30.0
LEASE_STALE_AFTER_S = 300.0


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
        self.holder = lease_holder()

    # --- locks --------------------------------------------------------------------------

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
                :func:`evict` leaves partial files there alone while the lock is live.
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
            record = {"holder": self.holder, "pidns": _PIDNS, "token": token, "started": now, "heartbeat": now, "model": what,
                      "writes": writes}
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
            write_atomic(path, json.dumps({**current, "heartbeat": time.time()}))

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
            writes = _parse(_read_text(path) or "").get("writes")
            if not isinstance(writes, list):
                return None
            folders += [str(w) for w in writes]
        return folders

    # --- leases -------------------------------------------------------------------------

    def lease(self, name: str, revision: str, path: Path) -> "Lease":
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
            held = Lease(file, {"holder": holder, "pidns": _PIDNS, "name": name, "revision": revision,
                                "path": self._relative(str(Path(path).resolve())), "started": now, "heartbeat": now})
            file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(file, json.dumps(held.record))
            _LEASES[str(file)] = held
            _start_lease_heartbeat()
        return held

    def leases(self) -> list["LeaseRecord"]:
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
        write_atomic(target, json.dumps({**asdict(entry), "path": self._relative(entry.path)}))
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
            write_atomic(self._entry_path(entry.name, entry.revision),
                          json.dumps({**asdict(used), "path": self._relative(used.path)}))
        return used

    def unmark(self, entry: Entry) -> None:
        """Delete ``entry``'s completion marker: from now on :meth:`find` does not return it."""
        self._entry_path(entry.name, entry.revision).unlink(missing_ok=True)

    def mark(self, entry: Entry) -> None:
        """Write ``entry``'s completion marker back as it was (an eviction that found a lease)."""
        write_atomic(self._entry_path(entry.name, entry.revision),
                      json.dumps({**asdict(entry), "path": self._relative(entry.path)}))

    def marked(self, name: str, revision: str, wait_s: float = 0.0) -> bool:
        """Whether the entry ``name`` at ``revision`` has its marker, waiting up to ``wait_s``
        seconds for one that an eviction is deciding about (see :func:`evict`)."""
        deadline = time.monotonic() + wait_s
        while not self._entry_path(name, revision).exists():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(self.poll_s, 0.05))
        return True

    def remove(self, entry: Entry) -> None:
        """Delete the marker (first, so nobody reuses a half-deleted copy), then the files. A Hugging
        Face snapshot is removed with huggingface_hub's own cache tools, which keep blobs that other
        revisions still link to."""
        self._entry_path(entry.name, entry.revision).unlink(missing_ok=True)
        root = self.root.resolve()
        hf_root = root / HF_DIR
        path = Path(entry.path).resolve()
        if not path.is_relative_to(root) or path in (root, hf_root, root / "s3"):
            log.warning("not removing %s: outside the cache %s", path, root)
            return
        if path.is_relative_to(hf_root):
            if any(e.revision == entry.revision and Path(e.path).is_relative_to(hf_root) for e in self.entries()):
                return  # the snapshot also backs another entry (another file selector of the same commit)
            _scan_hf(hf_root).delete_revisions(entry.revision).execute()
        elif not any(e.path == entry.path for e in self.entries()):
            folder = path.parent if path.is_file() else path  # a GGUF: its folder
            if folder.is_relative_to(root / "s3") and folder != root / "s3":
                shutil.rmtree(folder, ignore_errors=True)


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
    """This process's lease on one entry (:meth:`ModelCache.lease`)."""

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


def lease_holder() -> str:
    """This process as a lease holder: ``$HOSTNAME`` (the pod name in Kubernetes) and the pid."""
    return f"{os.environ.get('HOSTNAME') or socket.gethostname()}:{os.getpid()}"


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


def files_root(path: str, revision: str) -> str:
    """What removing an entry at ``revision`` whose files are at ``path`` deletes: for a Hugging
    Face entry its snapshot (``…/models--ORG--NAME@SHA``; ``path`` may be the snapshot folder or,
    for a GGUF, the blob it links to), for a GGUF file its folder, else ``path`` itself."""
    p = Path(path)
    for i, part in enumerate(p.parts):
        if part.startswith("models--"):
            return f"{Path(*p.parts[:i + 1])}@{revision}"
    return str(p.parent if p.suffix == ".gguf" else p)


def pinned_by(entry: Entry, leases: Iterable[LeaseRecord]) -> list[LeaseRecord]:
    """The leases that keep ``entry``: on the same entry and revision, or on files that removing
    the entry would delete (another file selector of the same snapshot)."""
    root = files_root(entry.path, entry.revision)
    return [lease for lease in leases if (lease.name, lease.revision) == (entry.name, entry.revision)
            or files_root(lease.path, lease.revision) == root]


@dataclass(frozen=True)
class Partial:
    """An unfinished download's file: ``path`` absolute, ``bytes`` its size, ``mtime`` epoch seconds."""
    path: str
    bytes: int
    mtime: float


def orphans(partials: Iterable[Partial], root: str, writing: list[str] | None, now: float,
            stale_after: float) -> list[Partial]:
    """The partial files that no download will finish: outside every folder in ``writing``
    (relative to ``root``, the folders of live lock holders; None: unknown, so every file may be
    written) and untouched for ``stale_after`` seconds (a writer that is not ours, such as ``hf
    download`` into the same cache, keeps its file's mtime fresh). Oldest first."""
    if writing is None:
        return []
    busy = [Path(root) / w for w in writing]
    out = [p for p in partials if now - p.mtime >= stale_after and not any(Path(p.path).is_relative_to(b) for b in busy)]
    return sorted(out, key=lambda p: p.mtime)


@dataclass(frozen=True)
class Eviction:
    """What :func:`evict` did. ``removed``: entries removed, least recently used first; ``in_use``:
    entries it would have removed but that a live lease pins; ``orphans``: partial files removed;
    ``total_bytes``: the bytes left of the entries' files (a blob shared by revisions once) and
    partial files."""
    removed: list[Entry]
    in_use: list[Entry]
    orphans: list[Partial]
    total_bytes: int


def evict(cache_dir: Path, max_bytes: int, keep: tuple[str, ...] = (), cache: ModelCache | None = None, *,
          lease_stale_after_s: float = LEASE_STALE_AFTER_S) -> Eviction:
    """Bring the cache down to ``max_bytes`` (the complete entries plus the partial files of
    unfinished downloads): first partial files that no live download is writing (oldest first,
    see :func:`orphans`), then least-recently-used entries. Never removed: entries whose model is
    locked (being fetched), entries with a live lease (a process serves them; the log line names
    the holders), and those whose name or path is in ``keep``. Lease files staler than
    ``lease_stale_after_s`` seconds are swept, and so are temporary files as old of writes that
    never finished (:func:`~.disk_cache.stray_temporaries`). The cache may stay above
    ``max_bytes`` when what is left is in use.

    A serving process keeps no file open once its weights are loaded, but one restarted in place
    (its init container does not run again) reads its revision again: the lease keeps it."""
    cache = cache or ModelCache(cache_dir)
    # One eviction at a time: pods that finish downloading together would each walk folders that
    # another one is removing, and count the same entry as theirs to free.
    with cache.lock(EVICT_LOCK, "the cache's eviction"):
        return _evict(cache, max_bytes, keep, lease_stale_after_s)


def _evict(cache: ModelCache, max_bytes: int, keep: tuple[str, ...], lease_stale_after_s: float) -> Eviction:
    now = time.time()
    root = str(cache.root.resolve())
    every_lease = cache.leases()
    for stale in set(every_lease) - set(live_leases(every_lease, now, lease_stale_after_s, gone)):
        log.info("removing the stale lease of %s on %s (no heartbeat for %.0f s, or no such process)", stale.holder,
                 stale.name, now - stale.heartbeat)
        with contextlib.suppress(OSError):
            Path(stale.file).unlink()
    # Only where write_atomic writes: the metadata and the Hub's refs (a model's own files may
    # have any name).
    where = [cache.root / META_DIR, *(cache.root / HF_DIR).glob("*/refs")]
    for stray in (f for d in where for f in stray_temporaries(d, lease_stale_after_s, now)):
        log.info("removing %s: a temporary file left by a write that never finished", stray)
        with contextlib.suppress(OSError):
            stray.unlink()
    kept = {str(Path(k).resolve()) for k in keep}
    entries = sorted(cache.entries(), key=lambda e: e.last_used)
    partials = _partials(cache.root)
    files = {e: _entry_files(e) for e in entries}
    # Each file once: revisions of one Hub repo link the blobs they share (huggingface_hub's layout).
    on_disk = {f: size for e in entries for f, size in files[e].items()}
    total = sum(on_disk.values()) + sum(p.bytes for p in partials)
    removed_orphans = []
    for p in orphans(partials, root, cache.writing(now), now, cache.stale_after_s):
        if total <= max_bytes:
            break
        log.info("removing %s (%d bytes): a partial file of a download that is no longer running", p.path, p.bytes)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p.path)
        total -= p.bytes
        removed_orphans.append(p)
    removed, in_use = [], []
    for e in entries:
        if total <= max_bytes:
            break
        if e.name in keep or e.path in kept or cache.is_locked(e.name):
            continue
        # Marker first, then the leases as they are now: a process that leases the entry after this
        # read finds no marker and waits for it (ModelCache.marked), so either we see its lease and
        # put the marker back, or it sees the entry gone; never a copy deleted under a new lease.
        cache.unmark(e)
        holders = pinned_by(e, live_leases(cache.leases(), time.time(), lease_stale_after_s, gone))
        if holders:
            cache.mark(e)
            log.info("not evicting %s at %s (%d bytes): in use by %s", e.model, e.revision, e.bytes,
                     ", ".join(sorted({h.holder for h in holders})))
            in_use.append(e)
            continue
        log.info("evicting %s at %s (%d bytes, last used %s)", e.model, e.revision, e.bytes,
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)))
        cache.remove(e)
        # what left the disk: a blob that another revision links to stays, and so do the files
        # of a snapshot that another file selector's entry still uses
        total -= sum(on_disk.pop(f) for f in files[e] if f in on_disk and not os.path.exists(f))
        removed.append(e)
    return Eviction(removed, in_use, removed_orphans, total)


def _entry_files(entry: Entry) -> dict[str, int]:
    """The files of ``entry`` on disk: real path (links into huggingface_hub's blobs followed) ->
    bytes; empty if its path is gone."""
    path = Path(entry.path)
    out = {}
    for f in [path] if path.is_file() else path.rglob("*"):
        with contextlib.suppress(OSError):
            real = os.path.realpath(f)
            if os.path.isfile(real):
                out[real] = os.stat(real).st_size
    return out


def _partials(root: Path) -> list[Partial]:
    """The unfinished downloads' files: huggingface_hub's ``*.incomplete`` blobs (as its own cache
    scan reports them) and s3.py's ``*.partial`` files."""
    paths: list[Path] = []
    hf_root = root / HF_DIR
    if hf_root.is_dir():
        try:
            paths += [f.file_path for f in _scan_hf(hf_root).incomplete_files]
        except AttributeError:  # huggingface_hub before incomplete_files: the same glob
            paths += list(hf_root.glob("*/blobs/*.incomplete"))
    paths += [p for p in (root / "s3").rglob("*.partial")] if (root / "s3").is_dir() else []
    out = []
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        out.append(Partial(str(Path(p).resolve()), st.st_size, st.st_mtime))
    return out


def _scan_hf(hf_root: Path, attempts: int = 3):
    """huggingface_hub's scan of its cache folder (``HFCacheInfo``), taken again when a download
    running beside it renamed or removed a file mid-walk (``FileNotFoundError`` from a stat)."""
    from huggingface_hub import scan_cache_dir

    for attempt in range(attempts):
        try:
            return scan_cache_dir(hf_root)
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.05)


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


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return ""


_PIDNS = _pid_namespace()


def gone(holder: str, pidns: str) -> bool:
    """Whether the process ``holder`` ("host:pid") is known to have exited: it ran on this host
    and in this pid namespace (``pidns`` as recorded) and no process has its pid now. Unknown
    (another host, another namespace, a record without ``pidns``): False."""
    host, _, pid = holder.rpartition(":")
    # isascii: str.isdigit accepts "²", which int() refuses
    if host != lease_holder().rpartition(":")[0] or not (pid.isascii() and pid.isdigit()) or not pidns \
            or pidns != _PIDNS:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive, owned by someone else; or no pid at all
        return False
    return False
