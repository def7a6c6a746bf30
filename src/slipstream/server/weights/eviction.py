"""Eviction by size: bring the model cache under a byte limit, least recently used first, never
removing what is being fetched or served (:mod:`.cache_lock`, :mod:`.leases`)."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .cache import Entry, ModelCache, scan_hf
from .cache_files import HF_DIR, META_DIR
from .disk_cache import stray_temporaries
from .holders import gone
from .leases import LEASE_STALE_AFTER_S, LeaseRecord, live_leases

log = logging.getLogger("slipstream.model_cache")

# The lock that evictions take, one at a time: cache_name() never makes a name that starts with a dot.
EVICT_LOCK = ".evict"


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
            paths += [f.file_path for f in scan_hf(hf_root).incomplete_files]
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
