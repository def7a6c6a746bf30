"""On-disk cache of what is derived from a model file (dequantized weights, converted tokenizers).

``$SLIPSTREAM_CACHE_DIR/<kind>/<key>``: the key hashes the source's path, size and mtime, so a
changed file gets a new entry. Each entry holds ``source.json`` naming the source path; when an
entry is written, older entries of the same path are removed (540 MB each for the built-in
model's weights). Entries from before ``source.json`` existed are removed once older than
:data:`UNLABELLED_MAX_AGE_S`; the next load of their file rebuilds them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path

log = logging.getLogger("slipstream.loader")

SOURCE_FILE = "source.json"
UNLABELLED_MAX_AGE_S = 30 * 86400
_KEY = re.compile(r"[0-9a-f]{16}")  # entry names; mkdtemp's "tmp…" folders being written never match


_TEMPORARY = re.compile(r"\..+\.[0-9a-f]{8}\.tmp")  # write_atomic's temporary files


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never half of
    it (a temporary file beside it, then a rename; unique per call, so threads do not collide).
    A failed write removes its temporary file; one left by a killed process is found by
    :func:`stray_temporaries`. Raises OSError as the write or the rename does."""
    # the name cut so the temporary stays within NAME_MAX (255 bytes) for a name that is near it
    tmp = path.with_name(f".{path.name[:200]}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def stray_temporaries(root: Path, older_than_s: float, now: float | None = None) -> list[Path]:
    """:func:`write_atomic`'s temporary files under ``root`` last modified more than
    ``older_than_s`` seconds before ``now`` (default: the clock): a write renames its file within
    milliseconds, so an old one is what a process killed mid-write left behind."""
    now = time.time() if now is None else now
    found = []
    try:
        candidates = list(root.rglob(".*.tmp"))
    except OSError:  # a folder removed while walking (another process evicting): next time
        return found
    for f in candidates:
        try:
            if _TEMPORARY.fullmatch(f.name) and f.is_file() and not f.is_symlink() \
                    and now - f.stat().st_mtime > older_than_s:
                found.append(f)
        except OSError:
            continue  # removed meanwhile
    return found


def cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slipstream")
    return Path(root)


def _key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


def cache_entry(path: Path, kind: str) -> Path:
    """A cache folder for what was derived from ``path``; a changed file gets a new one."""
    return cache_dir() / kind / _key(path)


def fill_cache(entry: Path, write, source: Path) -> None:
    """Create ``entry`` atomically (``write(tmp_dir)``, label it with ``source``, then rename),
    then remove the entries it replaces (:func:`stale_entries`); a failure only warns."""
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent))
        write(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"path": str(source.resolve())}))
        shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
        tmp = None
    except OSError as e:
        log.warning("could not write the cache %s: %s", entry, e)
        return
    finally:
        if tmp is not None:  # a half-written folder is never used; do not leave it behind
            shutil.rmtree(tmp, ignore_errors=True)
    for stale in stale_entries(entry, source):
        log.info("removing the stale cache %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def stale_entries(entry: Path, source: Path, now: float | None = None) -> list[Path]:
    """The other entries beside ``entry`` that it replaces: those whose ``source.json`` names the
    resolved ``source`` path, and unlabelled ones older than :data:`UNLABELLED_MAX_AGE_S`.

    Only finished entries (16-hex-digit folders, not symlinks) directly beside ``entry`` are
    considered, so a folder another process is still writing, and anything outside the cache,
    is never returned. A process still reading a removed entry keeps its memory map (POSIX
    unlink semantics); one about to open it finds it unreadable and rebuilds.
    """
    now = time.time() if now is None else now
    wanted = str(source.resolve())
    stale = []
    try:
        siblings = list(entry.parent.iterdir())
    except OSError:
        return []
    for other in siblings:
        if other.name == entry.name or not _KEY.fullmatch(other.name) or other.is_symlink() or not other.is_dir():
            continue
        try:
            label = json.loads((other / SOURCE_FILE).read_text())
        except FileNotFoundError:
            try:
                if now - other.stat().st_mtime > UNLABELLED_MAX_AGE_S:
                    stale.append(other)
            except OSError:
                pass
            continue
        except (OSError, ValueError):
            continue
        if isinstance(label, dict) and label.get("path") == wanted:
            stale.append(other)
    return sorted(stale)
