"""Where a model comes from: parse a model URI and fetch remote ones into the shared model cache.

Accepted forms (``--model``, ``LLM(model=...)``, ``slipstream download``):

=====================================  ==============================================================
``builtin``                            the packaged SmolLM2-135M-Instruct GGUF
``sim:PROFILE[,k=v...]``               the simulator (no weights)
``/abs``, ``./rel``, ``~/x``, ``x``    a local ``.gguf`` file or checkpoint directory; a path that
                                       exists always wins over the forms below
``hf://ORG/NAME[@REVISION][:FILE]``    a Hugging Face Hub repository; ``REVISION`` a branch, tag or
                                       commit sha (default ``main``); ``FILE`` picks files of a
                                       repository holding many quantizations: a glob
                                       (``*Q4_K_M.gguf``) or a quantization tag (``Q4_K_M``,
                                       case-insensitive, meaning ``*Q4_K_M*.gguf``)
``ORG/NAME[@REVISION][:FILE]``         the same, when no such local path exists
``s3://BUCKET/PREFIX``                 the objects under ``PREFIX/`` (or the one object ``PREFIX``)
=====================================  ==============================================================

The file selector follows ``:`` because neither a repository id (``[\\w.-]``) nor a git ref name
(``git check-ref-format``) may contain one, so it never collides with the name or the revision.
``pvc://`` and ``oci://`` belong to InferenceService specs: the operator mounts them and the pod
sees a path.

Cache layout (``--model-cache-dir``, default ``$SLIPSTREAM_MODEL_CACHE`` else
``~/.cache/slipstream/models``)::

    hf/                      huggingface_hub's own cache layout (models--ORG--NAME/{blobs,snapshots,refs}),
                             so an existing HF cache can be mounted here
    s3/BUCKET/PREFIX/        the objects, with .slipstream-s3.json (ETag and size of each file)
    .slipstream/             locks, completion markers and in-use leases (:mod:`.cache`)

A fetch with ``pinned_revision`` (``serve --model-revision-file``: what its pod's download step
resolved, :func:`read_revision_file`) reads that revision from the cache and nothing else, so a
server restarted in place serves what its pod fetched even after another fetch moved ``main`` (or
rewrote an S3 prefix's copy) in a shared cache; if the revision is gone it fails, reason
``NotCached``, saying the pod must be recreated.

A fetch stops at its next chunk (1 MiB, from the Hub or S3) once :func:`cancel_fetches`
is called (``slipstream download`` and ``serve`` do on SIGINT/SIGTERM), raising
:class:`Interrupted` and releasing its lock on the way out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from .errors import ModelLoadError
from .cache import HF_DIR, STALE_AFTER_S, Entry, Lease, ModelCache, cache_name

log = logging.getLogger("slipstream.sources")

SCHEMES = ("builtin", "sim", "local", "hf", "s3")
REASONS = ("Unauthorized", "GatedRepo", "NotFound", "RevisionNotFound", "Unreachable", "RateLimited", "InvalidURI",
           "InvalidEndpoint", "NotCached", "ChecksumMismatch", "CacheNotWritable", "Interrupted", "Unexpected")
RETRIED = ("Unreachable", "RateLimited")  # reasons a fetch tries again (with backoff) before giving up
RETRY_AFTER_MAX_S = 300.0  # seconds: the longest Retry-After a fetch waits for before its next try
ACCEPTED_FORMS = ("builtin, sim:PROFILE, a local path (a .gguf file or a checkpoint directory), "
                  "hf://ORG/NAME[@REVISION][:FILE], ORG/NAME[@REVISION][:FILE], s3://BUCKET/PREFIX")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def check_endpoint(url: str | None, what: str, model: str) -> str | None:
    """``url`` (None: the client's default) if it is an http(s) URL with a host; else a
    :class:`ModelSourceError` with reason ``InvalidEndpoint`` naming ``model`` and ``what`` set it (the
    clients raised a bare ValueError, or took it as a host name and said only that it was
    unreachable)."""
    if url is None:
        return None
    import urllib.parse

    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)
        parts.port  # a port out of range or not a number raises here
    except ValueError:
        ok = False
    if not ok:
        raise ModelSourceError(f"model {model!r}: {what} is {url!r}, not an http:// or https:// URL with a host "
                               "(and a port from 1 to 65535, if any)", reason="InvalidEndpoint")
    return url


class ModelSourceError(ModelLoadError):
    """A model could not be fetched. ``status``: the HTTP status (None without one); ``reason``: one
    of :data:`REASONS`, what the operator puts in the InferenceService's condition;
    ``retry_after``: seconds the server asked to wait before trying again (a 429's
    ``Retry-After``), or None."""

    def __init__(self, message: str, *, reason: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.reason, self.status, self.retry_after = reason, status, retry_after


class Interrupted(BaseException):
    """A fetch stopped by :func:`cancel_fetches` (a signal). A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way (ours, huggingface_hub's,
    botocore's retries) takes it for a network error. ``signum``: the signal, or None;
    ``exit_code``: 128 + ``signum`` (130 for SIGINT, 143 for SIGTERM), else 130."""

    def __init__(self, signum: int | None = None):
        self.signum = signum
        name = signal.Signals(signum).name if signum else "cancelled"
        super().__init__(f"fetch interrupted ({name})")

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


_cancel = threading.Event()
_cancel_signum: list[int | None] = [None]
_in_flight = [0]
_in_flight_guard = threading.Lock()


def cancel_fetches(signum: int | None = None) -> bool:
    """Make every running and later fetch of this process raise :class:`Interrupted` at its next
    check (each chunk, each wait); for a process that is stopping. ``signum``: the signal that
    asked, for the exit code. Returns whether a fetch was running. Safe from a signal handler."""
    _cancel_signum[0] = signum
    _cancel.set()
    return _in_flight[0] > 0


def cancelled() -> bool:
    """Whether :func:`cancel_fetches` was called (and not yet answered by a KeyboardInterrupt)."""
    return _cancel.is_set()


def check_cancelled() -> None:
    """Raise :class:`Interrupted` if :func:`cancel_fetches` was called (the fetchers' check)."""
    if _cancel.is_set():
        raise Interrupted(_cancel_signum[0])


@contextlib.contextmanager
def _fetching() -> Iterator[None]:
    """Count a running fetch; on the main thread, while Python's own SIGINT handler is in place, a
    Ctrl-C also stops the download threads (huggingface_hub's pool would otherwise finish every file
    it started before the KeyboardInterrupt got out). Nothing else about signals changes."""
    check_cancelled()
    with _in_flight_guard:
        _in_flight[0] += 1
    wrapped = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if wrapped:
        def on_sigint(signum, frame):
            cancel_fetches(signum)
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        with _in_flight_guard:
            _in_flight[0] -= 1
        if wrapped:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _cancel.is_set() and _cancel_signum[0] == signal.SIGINT:
                _cancel.clear()  # the KeyboardInterrupt is the caller's now; a later fetch may run


@dataclass(frozen=True)
class ModelURI:
    """A parsed model URI; only the fields of its ``scheme`` are set. ``text``: as given."""
    scheme: str
    text: str
    path: str | None = None  # local
    profile: str | None = None  # sim: everything after "sim:"
    repo_id: str | None = None  # hf
    revision: str = "main"  # hf
    filename: str | None = None  # hf: a glob choosing files
    bucket: str | None = None  # s3
    prefix: str | None = None  # s3, without a trailing "/"

    @property
    def identity(self) -> str:
        """The canonical URI (what the cache locks and records)."""
        if self.scheme == "hf":
            return f"hf://{self.repo_id}@{self.revision}" + (f":{self.filename}" if self.filename else "")
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        return self.text


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


def _invalid(text: str, why: str) -> ModelSourceError:
    return ModelSourceError(f"model {text!r}: {why}; accepted forms: {ACCEPTED_FORMS}", reason="InvalidURI")


def parse_model_uri(text: str) -> ModelURI:
    """Parse a model URI (forms in the module docstring).

    Raises:
        ModelSourceError: reason ``InvalidURI``, with the accepted forms in the message.
    """
    if not text or not text.strip():
        raise _invalid(text, "empty")
    if text == "builtin":
        return ModelURI("builtin", text)
    if text.startswith("sim:"):
        return ModelURI("sim", text, profile=text[4:])
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme == "hf":
            return _parse_hf(text, rest)
        if scheme == "s3":
            bucket, _, prefix = rest.partition("/")
            if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
                raise _invalid(text, f"{bucket!r} is not an S3 bucket name")
            return ModelURI("s3", text, bucket=bucket, prefix=prefix.strip("/"))
        if scheme in ("pvc", "oci"):
            raise ModelSourceError(
                f"model {text!r}: {scheme}:// models are for InferenceService specs (spec.model.uri): the operator "
                "mounts them into the pod, which sees a local path; here pass that path instead", reason="InvalidURI")
        if scheme == "file":
            if not rest:
                raise _invalid(text, "file:// names no path")
            return ModelURI("local", text, path=rest)
        raise _invalid(text, f"unknown scheme {scheme}://")
    local = Path(text).expanduser()
    if text.startswith(("/", "./", "../", "~")) or local.exists():
        return ModelURI("local", text, path=text)
    name = re.split(r"[@:]", text, maxsplit=1)[0]
    if _REPO_ID.match(name):
        return _parse_hf(text, text)
    return ModelURI("local", text, path=text)  # the loader says that it does not exist


def _parse_hf(text: str, rest: str) -> ModelURI:
    name_rev, colon, selector = rest.partition(":")
    repo_id, at, revision = name_rev.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.startswith(("datasets/", "spaces/")):
        raise _invalid(text, f"{repo_id!r} is not a Hugging Face model id (ORG/NAME)")
    if at and not revision:
        raise _invalid(text, "empty revision after '@'")
    if colon and not selector:
        raise _invalid(text, "empty file selector after ':' (e.g. :Q4_K_M or :*q8_0.gguf)")
    if "@" in revision or ":" in selector or any(c.isspace() for c in rest):
        raise _invalid(text, "one '@REVISION' and one ':FILE' at most, without spaces")
    return ModelURI("hf", text, repo_id=repo_id, revision=revision or "main", filename=_glob(selector) if selector else None)


def _glob(selector: str) -> str:
    """A glob as given; a bare quantization tag as ``*TAG*.gguf`` matching either case."""
    if any(c in selector for c in "*?[") or "." in selector:
        return selector
    return "*" + "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in selector) + "*.gguf"


def default_cache_dir() -> Path:
    """``$SLIPSTREAM_MODEL_CACHE``, else ``~/.cache/slipstream/models``."""
    return Path(os.environ.get("SLIPSTREAM_MODEL_CACHE") or "~/.cache/slipstream/models").expanduser()


def served_name(model: str) -> str | None:
    """The name a model is served under by default: ``ORG/NAME`` for Hugging Face models; None
    where the loader's own name (file or directory name) applies."""
    try:
        uri = parse_model_uri(model)
    except ModelSourceError:
        return None
    return uri.repo_id if uri.scheme == "hf" else None


# huggingface_hub's own rule: HF_HUB_OFFLINE when set (an image's HF_HUB_OFFLINE=0 overrides its
# TRANSFORMERS_OFFLINE=1), else TRANSFORMERS_OFFLINE
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _is_true(value: str | None) -> bool:
    return value is not None and value.upper() in ("1", "ON", "YES", "TRUE")  # huggingface_hub's test, unstripped


def _offline_var() -> str | None:
    """The environment variable that turns offline mode on, if one does: ``HF_HUB_OFFLINE``
    when set decides (``0`` keeps a process online whatever ``TRANSFORMERS_OFFLINE`` says), as
    in huggingface_hub."""
    name = next((n for n in _OFFLINE_VARS if os.environ.get(n)), None)
    return name if name is not None and _is_true(os.environ[name]) else None


def _offline_env() -> bool:
    return _offline_var() is not None


def offline_hint(flag: bool = False) -> str:
    """How to go online again, naming every cause: ``--offline`` (``flag``) and the variable
    that made this process offline: ``unset`` it where nothing else turns offline mode on, else
    ``set HF_HUB_OFFLINE=0`` (which decides over ``TRANSFORMERS_OFFLINE``)."""
    steps = ["drop --offline"] if flag else []
    var = _offline_var()
    if var is not None and all(n == var or not _is_true(os.environ.get(n)) for n in _OFFLINE_VARS):
        steps.append(f"unset {var}")
    elif var is not None:
        steps.append("set HF_HUB_OFFLINE=0")
    return " and ".join(steps) or "drop --offline"


# `slipstream serve --model-revision-file PATH` sets it for the loader (as --model-cache-dir sets
# SLIPSTREAM_MODEL_CACHE): the file `slipstream download --revision-file PATH` wrote.
REVISION_FILE_ENV = "SLIPSTREAM_MODEL_REVISION_FILE"


def read_revision_file(path: str | Path, uri: ModelURI) -> str:
    """The revision that ``slipstream download --revision-file`` recorded at ``path`` (its result
    JSON, ``{"model", "revision", ...}``) for the model ``uri``: what a pod's server pins its
    model to.

    Raises:
        ModelSourceError: no such file (reason ``NotCached``), or one that is not such a result
            or records another model (``InvalidURI``).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ModelSourceError(f"model {uri.text!r}: no revision file {path}, which `slipstream download "
                               "--revision-file` writes (the pod's download step) to say which revision to serve",
                               reason="NotCached") from None
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"model {uri.text!r}: cannot read the revision file {path}: {e}",
                               reason="InvalidURI") from None
    revision = doc.get("revision") if isinstance(doc, dict) else None
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(revision, str) or not revision or not isinstance(model, str):
        raise ModelSourceError(f"model {uri.text!r}: the revision file {path} holds no model and revision "
                               "(not written by `slipstream download --revision-file`)", reason="InvalidURI")
    try:
        same = parse_model_uri(model).identity == uri.identity
    except ModelSourceError:
        same = False
    if not same:
        raise ModelSourceError(f"model {uri.text!r}: the revision file {path} records the model {model!r}, "
                               "not this one", reason="InvalidURI")
    return revision


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
            (``--max-cache-bytes``) keeps it (:meth:`.ModelCache.lease`); for processes that serve
            the model. A cache this process cannot write gets no lease, with a warning.
        pinned_revision: serve exactly this revision (a commit sha; for S3, :func:`.s3.object_revision`)
            from the cache, never downloading and whatever ``refs/main`` now says: what the pod's
            download step resolved (:func:`read_revision_file`). Gone from the cache (evicted, or an
            S3 copy rewritten by a later fetch): reason ``NotCached``, saying to recreate the pod.

    Raises:
        ModelSourceError: with ``reason`` and ``status`` (see :data:`REASONS`).
        Interrupted: :func:`cancel_fetches` was called; the lock is released.
    """
    if uri.scheme not in ("hf", "s3"):
        raise ModelSourceError(f"model {uri.text!r}: {_not_fetchable(uri)}", reason="InvalidURI")
    cache_dir = Path(cache_dir).expanduser()
    with _fetching():
        try:
            return _fetch(uri, cache_dir, offline or _offline_env(), s3_endpoint, retries, backoff_s, stale_after_s,
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
                with _Progress(uri.text, cache_dir):
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
                    if _cancel.wait(wait):
                        check_cancelled()
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
    which :func:`.cache.evict` removes before it reads the leases and puts back when it
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
        from .hf import fetch_hf
        path, sha, files = fetch_hf(uri, cache_dir / HF_DIR, offline=offline)
        return path, sha, files_bytes(files)
    from .s3 import fetch_s3
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
        from .hf import fetch_hf
        try:
            path, sha, files = fetch_hf(dataclasses.replace(uri, revision=revision), cache_dir / HF_DIR, offline=True)
        except ModelSourceError as e:
            if e.reason != "NotCached":
                raise
            raise _pinned_gone(uri, revision, cache_dir, "") from e
        return path, sha, files_bytes(files)
    from .s3 import copy_folder, copy_revision
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


def files_bytes(files: Iterable[Path]) -> int:
    """Bytes of ``files`` (symlinks followed, as into huggingface_hub's blobs); missing ones count 0."""
    total = 0
    for f in files:
        with contextlib.suppress(OSError):
            total += Path(f).stat().st_size
    return total


_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


def several_ggufs(what: str, ggufs: list[str], example: str) -> ModelSourceError:
    """The error for a model that holds several GGUF files and names none of them (reason
    ``InvalidURI``): ``what`` leads the message (``"model 'x': org/name holds"``), ``example`` shows a
    URI that names one. The one wording for every source (hf, s3, local folders).
    Shards of one split model (``NAME-00001-of-00003.gguf``) get their own message: not supported."""
    if all(_SHARD.search(g) for g in ggufs) and len({_SHARD.sub("", g) for g in ggufs}) == 1:
        return ModelSourceError(f"{what} a GGUF model split into {len(ggufs)} shards ({', '.join(ggufs[:3])}"
                                f"{', ...' if len(ggufs) > 3 else ''}), which is not supported yet; merge them into one "
                                "file (llama.cpp: llama-gguf-split --merge) and serve that, or choose a quantization "
                                "stored as one file", reason="InvalidURI")
    return ModelSourceError(f"{what} {len(ggufs)} GGUF files ({', '.join(ggufs[:6])}{', ...' if len(ggufs) > 6 else ''}); "
                            f"choose one, e.g. {example}", reason="InvalidURI")


def weights_path(folder: Path, files: list[str], *, model: str | None = None, example: str | None = None) -> Path:
    """What the loader loads from a ``folder`` holding ``files`` (relative paths): the folder, or the
    GGUF file when that is the only weight file. Pure: it decides from the names, so a source can
    call it on a listing before downloading anything. ``model`` and ``example`` word the error
    (default: the folder, and a file-selector hint).

    Raises:
        ModelSourceError: several GGUF files and no safetensors (reason ``InvalidURI``).
    """
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if any(f.endswith(".safetensors") for f in files) or not ggufs:
        return folder
    if len(ggufs) > 1:
        raise several_ggufs(f"model {model!r} holds" if model else f"{folder}:", ggufs, example or
                            "a file selector (hf://ORG/NAME:*Q4_K_M.gguf) or an s3:// URI naming the one object")
    return folder / ggufs[0]


def progress_bar(name: str, total: int, initial: int = 0):
    """A terminal progress bar over one file's ``total`` bytes (``initial`` of them already there:
    a resumed download), updated with ``update(nbytes)`` and closed by ``close()``; disabled when
    stderr is not a terminal, where :class:`_Progress`'s log lines report instead."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=name, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not sys.stderr.isatty(), leave=False)


PROGRESS_INTERVAL_S = 10.0  # between progress lines in a fetch's log


class _Progress:
    """Logs bytes arrived under ``cache_dir`` every ``interval`` seconds while a fetch runs (pod logs
    get lines, not a progress bar)."""

    def __init__(self, what: str, cache_dir: Path, interval: float | None = None):
        self.what, self.cache_dir = what, cache_dir
        self.interval = PROGRESS_INTERVAL_S if interval is None else interval
        self.stop = threading.Event()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.interval):
            arrived = _bytes_under(self.cache_dir) - self.base
            log.info("fetching %s: %.1f MB so far (%.1f MB/s)", self.what, arrived / 1e6,
                     arrived / 1e6 / (time.monotonic() - t0))

    def __enter__(self):
        self.base = _bytes_under(self.cache_dir)
        self.thread = threading.Thread(target=self._run, name="fetch progress", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                continue
    return total
