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

The lock is in :mod:`.cache_lock`, the leases in :mod:`.leases`, eviction by size in
:mod:`.eviction`; this module holds the entries (completion markers) and the class that joins them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .cache_files import HF_DIR, META_DIR, relative_path
from .cache_lock import HEARTBEAT_S, STALE_AFTER_S, CacheLocks
from .disk_cache import write_atomic
from .holders import lease_holder
from .leases import CacheLeases

log = logging.getLogger("slipstream.model_cache")


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


class ModelCache(CacheLocks, CacheLeases):
    """Locks, leases and completion markers under ``root`` (see the module docstring).

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
        write_atomic(target, json.dumps({**asdict(entry), "path": relative_path(self.root, entry.path)}))
        return entry

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
                          json.dumps({**asdict(used), "path": relative_path(self.root, used.path)}))
        return used

    def unmark(self, entry: Entry) -> None:
        """Delete ``entry``'s completion marker: from now on :meth:`find` does not return it."""
        self._entry_path(entry.name, entry.revision).unlink(missing_ok=True)

    def mark(self, entry: Entry) -> None:
        """Write ``entry``'s completion marker back as it was (an eviction that found a lease)."""
        write_atomic(self._entry_path(entry.name, entry.revision),
                      json.dumps({**asdict(entry), "path": relative_path(self.root, entry.path)}))

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
            scan_hf(hf_root).delete_revisions(entry.revision).execute()
        elif not any(e.path == entry.path for e in self.entries()):
            folder = path.parent if path.is_file() else path  # a GGUF: its folder
            if folder.is_relative_to(root / "s3") and folder != root / "s3":
                shutil.rmtree(folder, ignore_errors=True)


def scan_hf(hf_root: Path, attempts: int = 3):
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
