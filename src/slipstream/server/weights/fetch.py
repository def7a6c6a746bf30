"""Fetch a remote model (``hf://``, ``s3://``; :mod:`.uri`) into the shared model cache.

Cache layout (``--model-cache-dir``, default ``$SLIPSTREAM_MODEL_CACHE`` else
``~/.cache/slipstream/models``)::

    hf/                      huggingface_hub's own cache layout (models--ORG--NAME/{blobs,snapshots,refs}),
                             so an existing HF cache can be mounted here
    s3/BUCKET/PREFIX/        the objects, with .slipstream-s3.json (ETag and size of each file)
    .slipstream/             locks, completion markers and in-use leases (:mod:`.cache`)

A fetch with ``pinned_revision`` (``serve --model-revision-file``: what its pod's download step
resolved, :func:`.revision_file.read_revision_file`) reads that revision from the cache and nothing else, so a
server restarted in place serves what its pod fetched even after another fetch moved ``main`` (or
rewrote an S3 prefix's copy) in a shared cache; if the revision is gone it fails, reason
``NotCached``, saying the pod must be recreated.

A fetch stops at its next chunk (1 MiB, from the Hub or S3) once :func:`cancel_fetches`
is called (``slipstream download`` and ``serve`` do on SIGINT/SIGTERM), raising
:class:`Interrupted` and releasing its lock on the way out.

A fetch stops at its next chunk (1 MiB, from the Hub or S3) once :func:`.cancel.cancel_fetches`
is called, raising :class:`.cancel.Interrupted` and releasing its lock on the way out.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from .cache import Entry, ModelCache, cache_name
from .cache_files import HF_DIR
from .cache_lock import STALE_AFTER_S
from .cancel import check_cancelled, fetching, sleep
from .errors import ModelSourceError
from .files import files_bytes
from .hf import fetch_hf
from .leases import Lease
from .offline import offline_env, offline_hint
from .progress import Progress
from .s3 import copy_folder, copy_revision, fetch_s3
from .uri import ModelURI

log = logging.getLogger("slipstream.sources")

RETRIED = ("Unreachable", "RateLimited")  # reasons a fetch tries again (with backoff) before giving up
RETRY_AFTER_MAX_S = 300.0  # seconds: the longest Retry-After a fetch waits for before its next try
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class FetchResult:
    """A fetched model: ``path`` to load (a checkpoint directory, or the one GGUF file chosen);
    ``revision`` the commit sha (hf) or a hash of the objects' ETags (s3); ``bytes`` the size of the
    files the URI selected (not of everything in a shared snapshot folder); ``seconds`` the time
    the fetch took; ``lease`` this process's in-use lease on the copy (None when not asked for, or
    when the cache is read-only)."""
    path: Path
    revision: str
    bytes: int
    seconds: float
    lease: Lease | None = field(default=None, compare=False, repr=False)


def default_cache_dir() -> Path:
    """``$SLIPSTREAM_MODEL_CACHE``, else ``~/.cache/slipstream/models``."""
    return Path(os.environ.get("SLIPSTREAM_MODEL_CACHE") or "~/.cache/slipstream/models").expanduser()


def fetch(uri: ModelURI, cache_dir: Path, *, offline: bool = False, s3_endpoint: str | None = None,
          retries: int = 3, backoff_s: float = 1.0, stale_after_s: float = STALE_AFTER_S,
          lease: bool = True, pinned_revision: str | None = None) -> FetchResult:
    """Fetch a ``hf`` or ``s3`` model into ``cache_dir`` (layout in the module docstring), at most
    one process at a time per model: others wait for it and reuse its complete copy.

    Args:
        offline: resolve from the cache only (also when ``HF_HUB_OFFLINE=1``).
        s3_endpoint: the S3 endpoint URL (default ``$AWS_ENDPOINT_URL``, else AWS).
        retries, backoff_s: network errors (reason ``Unreachable``) and rate limits (HTTP 429,
            ``RateLimited``) are tried again ``retries`` times after ``backoff_s``, 2×, 4× … seconds,
            or after a 429's ``Retry-After`` (at most :data:`RETRY_AFTER_MAX_S`); a Hub download
            resumes the files it had begun. When all fail, a complete cached copy of the same
            model is used if there is one. HTTP 401/403/404 and ``ChecksumMismatch`` fail at once.
        stale_after_s: seconds without a heartbeat after which another process's lock is taken over.
        lease: hold an in-use lease on the copy until this process exits, so that eviction
            (``--max-cache-bytes``) keeps it (:meth:`.leases.CacheLeases.lease`); for processes that serve
            the model. A cache this process cannot write gets no lease, with a warning.
        pinned_revision: serve exactly this revision (a commit sha; for S3, :func:`.s3.object_revision`)
            from the cache, never downloading and whatever ``refs/main`` now says: what the pod's
            download step resolved (:func:`.revision_file.read_revision_file`). Gone from the cache (evicted, or an
            S3 copy rewritten by a later fetch): reason ``NotCached``, saying to recreate the pod.

    Raises:
        ModelSourceError: with ``reason`` and ``status`` (see :data:`REASONS`).
        Interrupted: :func:`.cancel.cancel_fetches` was called; the lock is released.
    """
    if uri.scheme not in ("hf", "s3"):
        raise ModelSourceError(f"model {uri.text!r}: {_not_fetchable(uri)}", reason="InvalidURI")
    cache_dir = Path(cache_dir).expanduser()
    with fetching():
        try:
            return _fetch(uri, cache_dir, offline or offline_env(), s3_endpoint, retries, backoff_s, stale_after_s,
                          lease, pinned_revision)
        except ModelSourceError as e:
            if e.reason != "NotCached" or pinned_revision is not None:  # going online would not bring it back
                raise
            # only here is it known whether --offline was given, beside the environment
            raise ModelSourceError(f"{e} (to go online: {offline_hint(offline)})", reason=e.reason,
                                   status=e.status) from e.__cause__


def _not_fetchable(uri: ModelURI) -> str:
    if uri.scheme == "local" and not Path(uri.path).expanduser().exists():
        return ("no such local file or directory, and not a remote model: name one as "
                "hf://ORG/NAME[@REVISION][:FILE] (or ORG/NAME[@REVISION][:FILE]) or s3://BUCKET/PREFIX")
    if uri.scheme == "local":
        return "a local path: nothing to download (serve it as it is with --model)"
    return f"a {uri.scheme} model has no weights to download"


def _fetch(uri: ModelURI, cache_dir: Path, offline: bool, s3_endpoint: str | None, retries: int, backoff_s: float,
           stale_after_s: float, lease: bool, pinned: str | None = None) -> FetchResult:
    start = time.perf_counter()
    cache = ModelCache(cache_dir, stale_after_s=stale_after_s)
    name = cache_name(uri.identity)
    if pinned is not None:
        path, revision, nbytes = _pinned_copy(uri, cache_dir, cache, name, pinned)
        held = _hold(cache, name, revision, path, uri.text, marked=cache.marked(name, revision)) if lease else None
        log.info("serving %s at revision %s, the one this pod's download step fetched: %s", uri.text, revision, path)
        return FetchResult(path, revision, nbytes, time.perf_counter() - start, held)
    if uri.scheme == "hf" and _COMMIT.match(uri.revision) and (entry := cache.find(name, uri.revision)):
        return _reuse(cache, entry, start, "pinned revision already complete", lease)
    if offline:
        path, revision, nbytes = _download(uri, cache_dir, s3_endpoint, offline=True, cache=cache, name=name)
        # a copy without our marker (an HF cache filled by other tools) is never evicted by us
        held = _hold(cache, name, revision, path, uri.text, marked=cache.marked(name, revision)) if lease else None
        return FetchResult(path, revision, nbytes, time.perf_counter() - start, held)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with cache.lock(name, uri.text, writes=_writes(uri), check=check_cancelled) as lock:
        if lock.waited_since is not None and (entry := cache.find(name, completed_after=lock.waited_since)):
            return _reuse(cache, entry, start, "fetched by the process we waited for", lease)
        for attempt in range(retries + 1):
            check_cancelled()
            try:
                with Progress(uri.text, cache_dir):
                    path, revision, nbytes = _download(uri, cache_dir, s3_endpoint, offline=False, cache=cache,
                                                       name=name)
                break
            except ModelSourceError as e:
                if e.reason not in RETRIED:
                    raise
                if attempt < retries:
                    wait = backoff_s * 2 ** attempt
                    if e.retry_after is not None:  # the server said when; bounded, as a Hub may ask for an hour
                        wait = min(max(e.retry_after, wait), RETRY_AFTER_MAX_S)
                    log.warning("%s (try %d of %d; again in %.0f s)", e, attempt + 1, retries + 1, wait)
                    sleep(wait)
                elif entry := cache.find(name):
                    log.warning("%s; serving the cached copy at revision %s", e, entry.revision)
                    return _reuse(cache, entry, start, "source unreachable", lease)
                else:
                    raise
        cache.record(name, model=uri.text, requested=uri.identity, revision=revision, path=path, nbytes=nbytes)
        held = _hold(cache, name, revision, path, uri.text) if lease else None  # before the lock goes: no gap for evict
    result = FetchResult(path, revision, nbytes, time.perf_counter() - start, held)
    log.info("fetched %s at revision %s: %.1f MB in %.1f s -> %s", uri.text, revision, result.bytes / 1e6,
             result.seconds, path)
    return result


def _writes(uri: ModelURI) -> list[str]:
    """The folders, relative to the cache root, a download of ``uri`` writes partial files in."""
    if uri.scheme == "hf":
        return [f"hf/models--{uri.repo_id.replace('/', '--')}"]
    base = f"s3/{uri.bucket}" + (f"/{uri.prefix}" if uri.prefix else "")
    return [base, base + ".d"] if uri.prefix else [base]


LEASE_CONFIRM_S = 2.0  # seconds to wait for an eviction that found our lease to put the marker back


def _hold(cache: ModelCache, name: str, revision: str, path: Path, model: str, marked: bool = True) -> Lease | None:
    """Lease the copy at ``path``, then check that it is still complete: an eviction may have
    chosen it between our look and the lease. ``marked``: the entry has a completion marker,
    which :func:`.eviction.evict` removes before it reads the leases and puts back when it
    finds one, so the marker (waited for briefly) is the check; else the files' presence."""
    try:
        held = cache.lease(name, revision, path)
    except OSError as e:
        log.warning("model %s: cannot record that this process uses %s (%s); an eviction elsewhere "
                    "(--max-cache-bytes) may remove it while it is served", model, path, e)
        return None
    if not (cache.marked(name, revision, wait_s=LEASE_CONFIRM_S) if marked else Path(path).exists()):
        held.release()
        raise ModelSourceError(f"model {model!r}: {path} was evicted from the cache while this process "
                               "opened it; fetch it again", reason="NotCached")
    return held


def _download(uri: ModelURI, cache_dir: Path, s3_endpoint: str | None, *, offline: bool, cache: ModelCache,
              name: str) -> tuple[Path, str, int]:
    """The path to load, the revision and the bytes of the files the URI selected."""
    if uri.scheme == "hf":
        path, sha, files = fetch_hf(uri, cache_dir / HF_DIR, offline=offline)
        return path, sha, files_bytes(files)
    if offline:
        entry = cache.find(name)
        if entry is None:
            raise ModelSourceError(f"model {uri.text!r}: offline, and the cache {cache_dir} holds no complete copy; "
                                   "fetch it once online",
                                   reason="NotCached")
        return Path(entry.path), entry.revision, entry.bytes
    path, revision, files = fetch_s3(uri, cache_dir / "s3", endpoint=s3_endpoint)
    return path, revision, files_bytes(files)


def _pinned_copy(uri: ModelURI, cache_dir: Path, cache: ModelCache, name: str, revision: str) -> tuple[Path, str, int]:
    """The cached copy of ``uri`` at exactly ``revision`` (path, revision, bytes), from the cache alone.

    Raises:
        ModelSourceError: reason ``NotCached`` (:func:`_pinned_gone`) when the cache no longer holds it.
    """
    if uri.scheme == "hf":
        try:
            path, sha, files = fetch_hf(dataclasses.replace(uri, revision=revision), cache_dir / HF_DIR, offline=True)
        except ModelSourceError as e:
            if e.reason != "NotCached":
                raise
            raise _pinned_gone(uri, revision, cache_dir, "") from e
        return path, sha, files_bytes(files)
    entry = cache.find(name, revision)
    # one folder per prefix, rewritten in place by any later fetch: its manifest says what it holds now
    holds = copy_revision(copy_folder(uri, cache_dir / "s3", Path(entry.path))) if entry else None
    if entry is None or holds != revision:
        raise _pinned_gone(uri, revision, cache_dir, f" (its copy {entry.path} now holds revision {holds}: a later "
                                                     "fetch of the same prefix replaced it)" if entry else "")
    return Path(entry.path), entry.revision, entry.bytes


def _pinned_gone(uri: ModelURI, revision: str, cache_dir: Path, detail: str) -> ModelSourceError:
    """The error of a pinned revision the cache no longer holds: reason ``NotCached``, as a copy
    evicted while a server opens it (:func:`_hold`)."""
    return ModelSourceError(
        f"model {uri.text!r}: revision {revision}, which the revision file names (in a pod: what its download "
        f"step fetched), is not in the model cache {cache_dir}{detail}: evicted (spec.model.cache.maxSize, "
        "--max-cache-bytes), replaced, or fetched into another cache (--model-cache-dir); this server serves that "
        "revision only, from the cache. In a pod, recreate it (kubectl delete pod) so that its download step "
        "fetches the model again; by hand, run slipstream download --revision-file into this cache",
        reason="NotCached")


def _reuse(cache: ModelCache, entry: Entry, start: float, why: str, lease: bool) -> FetchResult:
    held = _hold(cache, entry.name, entry.revision, Path(entry.path), entry.model) if lease else None
    cache.touch(entry)
    log.info("using the cached %s at revision %s (%s): %s", entry.model, entry.revision, why, entry.path)
    return FetchResult(Path(entry.path), entry.revision, entry.bytes, time.perf_counter() - start, held)
