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
    .slipstream/             locks and completion markers (:mod:`.model_cache`)
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelLoadError
from .model_cache import STALE_AFTER_S, Entry, ModelCache, cache_name

log = logging.getLogger("slipstream.sources")

SCHEMES = ("builtin", "sim", "local", "hf", "s3")
REASONS = ("Unauthorized", "GatedRepo", "NotFound", "RevisionNotFound", "Unreachable", "InvalidURI", "NotCached")
ACCEPTED_FORMS = ("builtin, sim:PROFILE, a local path (a .gguf file or a checkpoint directory), "
                  "hf://ORG/NAME[@REVISION][:FILE_GLOB], ORG/NAME[@REVISION][:FILE_GLOB], s3://BUCKET/PREFIX")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class ModelSourceError(ModelLoadError):
    """A model could not be fetched. ``status``: the HTTP status (None without one); ``reason``: one
    of :data:`REASONS`, what the operator puts in the InferenceService's condition."""

    def __init__(self, message: str, *, reason: str, status: int | None = None):
        super().__init__(message)
        self.reason, self.status = reason, status


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
    ``revision`` the commit sha (hf) or a hash of the objects' ETags (s3); ``bytes`` the size of its
    files; ``seconds`` the time the fetch took."""
    path: Path
    revision: str
    bytes: int
    seconds: float


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
    name_rev, _, selector = rest.partition(":")
    repo_id, at, revision = name_rev.partition("@")
    if not _REPO_ID.match(repo_id) or ".." in repo_id or repo_id.startswith(("datasets/", "spaces/")):
        raise _invalid(text, f"{repo_id!r} is not a Hugging Face model id (ORG/NAME)")
    if at and not revision:
        raise _invalid(text, "empty revision after '@'")
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


def _offline_env() -> bool:
    # huggingface_hub's own rule: TRANSFORMERS_OFFLINE counts too
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "true", "yes", "on")


def fetch(uri: ModelURI, cache_dir: Path, *, offline: bool = False, s3_endpoint: str | None = None,
          retries: int = 3, backoff_s: float = 1.0, stale_after_s: float = STALE_AFTER_S) -> FetchResult:
    """Fetch a ``hf`` or ``s3`` model into ``cache_dir`` (layout in the module docstring), at most
    one process at a time per model: others wait for it and reuse its complete copy.

    Args:
        offline: resolve from the cache only (also when ``HF_HUB_OFFLINE=1``).
        s3_endpoint: the S3 endpoint URL (default ``$AWS_ENDPOINT_URL``, else AWS).
        retries, backoff_s: network errors (reason ``Unreachable``) are tried again ``retries``
            times after ``backoff_s``, 2×, 4× … seconds; when all fail, a complete cached copy of
            the same model is used if there is one. HTTP 401/403/404 fail at once.
        stale_after_s: seconds without a heartbeat after which another process's lock is taken over.

    Raises:
        ModelSourceError: with ``reason`` and ``status`` (see :data:`REASONS`).
    """
    if uri.scheme not in ("hf", "s3"):
        raise ModelSourceError(f"model {uri.text!r}: nothing to fetch ({uri.scheme} models are local)",
                               reason="InvalidURI")
    cache_dir = Path(cache_dir).expanduser()
    start = time.perf_counter()
    cache = ModelCache(cache_dir, stale_after_s=stale_after_s)
    name = cache_name(uri.identity)
    offline = offline or _offline_env()
    if uri.scheme == "hf" and _COMMIT.match(uri.revision) and (entry := cache.find(name, uri.revision)):
        return _reuse(cache, entry, start, "pinned revision already complete")
    if offline:
        path, revision = _download(uri, cache_dir, s3_endpoint, offline=True, cache=cache, name=name)
        return _result(path, revision, start)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with cache.lock(name, uri.text) as lock:
        if lock.waited_since is not None and (entry := cache.find(name, completed_after=lock.waited_since)):
            return _reuse(cache, entry, start, "fetched by the process we waited for")
        for attempt in range(retries + 1):
            try:
                with _Progress(uri.text, cache_dir):
                    path, revision = _download(uri, cache_dir, s3_endpoint, offline=False, cache=cache, name=name)
                break
            except ModelSourceError as e:
                if e.reason != "Unreachable":
                    raise
                if attempt < retries:
                    wait = backoff_s * 2 ** attempt
                    log.warning("%s (try %d of %d; again in %.0f s)", e, attempt + 1, retries + 1, wait)
                    time.sleep(wait)
                elif entry := cache.find(name):
                    log.warning("%s; serving the cached copy at revision %s", e, entry.revision)
                    return _reuse(cache, entry, start, "source unreachable")
                else:
                    raise
        result = _result(path, revision, start)
        cache.record(name, model=uri.text, requested=uri.identity, revision=revision, path=path, nbytes=result.bytes)
    log.info("fetched %s at revision %s: %.1f MB in %.1f s -> %s", uri.text, revision, result.bytes / 1e6,
             result.seconds, path)
    return result


def _download(uri: ModelURI, cache_dir: Path, s3_endpoint: str | None, *, offline: bool, cache: ModelCache,
              name: str) -> tuple[Path, str]:
    if uri.scheme == "hf":
        from .hf_source import fetch_hf
        return fetch_hf(uri, cache_dir / "hf", offline=offline)
    from .s3_source import fetch_s3
    if offline:
        entry = cache.find(name)
        if entry is None:
            raise ModelSourceError(f"model {uri.text!r}: offline, and the cache {cache_dir} holds no complete copy; "
                                   "fetch it once online (slipstream download) or unset HF_HUB_OFFLINE",
                                   reason="NotCached")
        return Path(entry.path), entry.revision
    return fetch_s3(uri, cache_dir / "s3", endpoint=s3_endpoint)


def _reuse(cache: ModelCache, entry: Entry, start: float, why: str) -> FetchResult:
    cache.touch(entry)
    log.info("using the cached %s at revision %s (%s): %s", entry.model, entry.revision, why, entry.path)
    return FetchResult(Path(entry.path), entry.revision, entry.bytes, time.perf_counter() - start)


def _result(path: Path, revision: str, start: float) -> FetchResult:
    return FetchResult(path, revision, tree_bytes(path), time.perf_counter() - start)


def tree_bytes(path: Path) -> int:
    """Bytes of the file at ``path`` or of the files under it (symlinks followed, bookkeeping files
    starting with ``.`` left out)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def weights_path(folder: Path, files: list[str]) -> Path:
    """What the loader loads from a fetched ``folder`` holding ``files`` (relative paths): the
    folder, or the GGUF file when that is the only weight file.

    Raises:
        ModelSourceError: several GGUF files and no safetensors (reason ``InvalidURI``).
    """
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if any(f.endswith(".safetensors") for f in files) or not ggufs:
        return folder
    if len(ggufs) > 1:
        raise ModelSourceError(f"{folder}: {len(ggufs)} GGUF files ({', '.join(ggufs[:4])}); choose one with "
                               "a file selector (hf://ORG/NAME:*Q4_K_M.gguf) or an s3:// URI naming the one object", reason="InvalidURI")
    return folder / ggufs[0]


class _Progress:
    """Logs bytes arrived under ``cache_dir`` every ``interval`` seconds while a fetch runs (pod logs
    get lines, not a progress bar)."""

    def __init__(self, what: str, cache_dir: Path, interval: float = 10.0):
        self.what, self.cache_dir, self.interval = what, cache_dir, interval
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
