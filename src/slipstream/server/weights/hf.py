"""Fetch a Hugging Face Hub model with huggingface_hub into its standard cache layout.

Only what the loader reads comes down: ``*.safetensors`` or the chosen ``*.gguf``, the config
and generation config, tokenizer files and chat templates; pickles (``*.bin``, ``*.pt``, …) never.

A download stops at its next chunk once :func:`.cancel.cancel_fetches` is called: the check
rides on the progress bar class huggingface_hub lets a caller pass (``tqdm_class``), whose
``update`` every download thread calls per chunk. huggingface_hub reads 10 MiB chunks (80 s on a
1 Mbit/s link, past a pod's 30 s grace period), so this module lowers its
``constants.DOWNLOAD_CHUNK_SIZE`` (read at each request) to :data:`CHUNK_BYTES`.

LFS files (the weights: each listed with its sha256 by ``model_info(files_metadata=True)``) are
downloaded here, not by huggingface_hub, for two things it does not do: huggingface_hub 1.18 and
later write each try to a file of its own (``blobs/<etag>.<nonce>.incomplete``), delete it when the
try fails and never resume one, and they check only the size. Here each LFS file goes to
``blobs/<sha256>.incomplete``, a name the next try finds again: a download that was killed or
failed resumes it with ``Range: bytes=N-``. Its sha256 is computed while it streams (on resume the
bytes already there are read once more) and compared with the listed one before the file is
renamed to ``blobs/<sha256>``, where ``snapshot_download`` finds it and only links it into the
snapshot; a mismatch deletes the file and fails with reason ``ChecksumMismatch``. A blob already
in the cache (fetched earlier, or by other tools into a mounted HF cache) is not hashed again. Small
files (configs, tokenizers) still come through ``snapshot_download``. The cache's eviction removes
partial files of downloads that nobody finishes (:func:`.cache.evict`).
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import logging
import os
import re
import sys
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from .disk_cache import write_atomic
from .cancel import Interrupted, check_cancelled
from .endpoint import check_endpoint
from .errors import ModelSourceError
from .files import several_ggufs, weights_path
from .progress import progress_bar
from .uri import ModelURI

log = logging.getLogger("slipstream.sources")

CHUNK_BYTES = 1 << 20  # bytes between cancellation checks (and progress updates) of a Hub download
MAX_WORKERS = 8  # LFS files downloaded at once (snapshot_download's default)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

METADATA_PATTERNS = [
    "config.json", "generation_config.json", "special_tokens_map.json",
    "tokenizer*", "vocab.json", "merges.txt", "added_tokens.json",  # slow tokenizers' files beside tokenizer.json
    "chat_template.json", "chat_template.jinja", "additional_chat_templates/*.jinja",
]
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def select_files(uri: ModelURI, files: list[str]) -> list[str]:
    """The repository files to download out of ``files``: the weights (the selector's GGUF files,
    else ``*.safetensors``, else the one ``*.gguf``) and the metadata files.

    Raises:
        ModelSourceError: no weights in a format that is safe to load, nothing matching the
            selector, or several GGUF files and no selector (reason ``NotFound`` / ``InvalidURI``).
    """
    def top(pattern: str) -> list[str]:  # the loader reads weights at the top of the folder only
        return sorted(f for f in files if "/" not in f and fnmatch.fnmatchcase(f, pattern))

    if uri.filename:
        matched = sorted(f for f in files if fnmatch.fnmatchcase(f, uri.filename))
        weights = [f for f in matched if f.endswith((".gguf", ".safetensors"))]  # never a pickle, never README
        if not weights:
            ggufs = top("*.gguf")
            refused = f" (only {', '.join(matched[:4])}, which are not GGUF or safetensors weights)" if matched else ""
            raise ModelSourceError(
                f"model {uri.text!r}: no GGUF or safetensors file of {uri.repo_id}@{uri.revision} matches "
                f"{uri.filename!r}{refused}" + (f"; GGUF files: {', '.join(ggufs[:8])}" if ggufs else ""),
                reason="NotFound", status=404)
        ggufs = [f for f in weights if f.endswith(".gguf") and "/" not in f]
        if len(ggufs) > 1 and not any(f.endswith(".safetensors") for f in weights):
            raise several_ggufs(f"model {uri.text!r}: {uri.filename!r} matches", ggufs, f"hf://{uri.repo_id}:{ggufs[0]}")
    else:
        # Mistral's repositories also ship their own format (consolidated.safetensors): the HF one only
        safetensors = top("*.safetensors")
        hf_format = [f for f in safetensors if not f.startswith("consolidated")]
        weights = hf_format or safetensors or top("*.gguf")
        if len(weights) > 1 and weights[0].endswith(".gguf"):
            raise several_ggufs(f"model {uri.text!r}: {uri.repo_id} holds", weights,
                                f"hf://{uri.repo_id}:{weights[0]} or a quantization tag such as hf://ORG/NAME:Q4_K_M")
        if not weights:
            pickles = [f for f in files if any(fnmatch.fnmatchcase(f, p) for p in PICKLES)]
            raise ModelSourceError(
                f"model {uri.text!r}: {uri.repo_id}@{uri.revision} has no *.safetensors or *.gguf weights"
                + (f"; only pickle checkpoints ({', '.join(pickles[:3])}), which can run code on load and are "
                   "refused: use a safetensors or GGUF version of the model" if pickles else ""),
                reason="NotFound", status=404)
    meta = [f for f in files if any(fnmatch.fnmatchcase(f, p) for p in METADATA_PATTERNS)]
    return sorted(set(weights) | set(meta))


def fetch_hf(uri: ModelURI, hf_cache: Path, *, offline: bool) -> tuple[Path, str, list[Path]]:
    """Download (or, ``offline``, find in ``hf_cache``) the files :func:`select_files` picks.
    Returns the path to load, the commit sha and the selected files' paths in the snapshot folder
    (which may hold other selectors' files of the same commit too). The endpoint is
    ``$HF_ENDPOINT`` and the token ``$HF_TOKEN`` (else a saved ``hf auth login``), read at each call.

    Raises:
        ModelSourceError: see :func:`map_error`; reason ``ChecksumMismatch`` for an LFS file whose
            sha256 is not the listed one (deleted), ``Unreachable`` for one whose body ended early
            (kept, and resumed by the next try).
        Interrupted: :func:`.cancel.cancel_fetches` was called.
    """
    # read here at each call (huggingface_hub reads it once, at import, and fails there on a bad one)
    endpoint = check_endpoint(os.environ.get("HF_ENDPOINT"), "HF_ENDPOINT", uri.text)  # set but empty: invalid too
    import huggingface_hub.constants
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():  # pod logs get progress.py's log lines, not bars redrawn with \r
        disable_progress_bars()
    token = os.environ.get("HF_TOKEN") or None
    try:
        if offline:
            sha, files = _cached_listing(uri, hf_cache)
        else:
            info = HfApi(endpoint=endpoint, token=token).model_info(uri.repo_id, revision=uri.revision,
                                                                    files_metadata=True)
            sha, files = info.sha, [s.rfilename for s in info.siblings or []]
            lfs = _lfs_files(uri, info.siblings or [])
        selected = select_files(uri, files)
        log.info("%s: revision %s, %d file%s: %s", uri.text, sha, len(selected), "" if len(selected) == 1 else "s",
                 ", ".join(selected))
        huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE = min(huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)
        if not offline:
            _fetch_blobs(uri, hf_cache, sha, {f: lfs[f] for f in selected if f in lfs}, endpoint=endpoint,
                         token=token)
        folder = snapshot_download(uri.repo_id, revision=sha, cache_dir=hf_cache, allow_patterns=selected,
                                   token=token, endpoint=endpoint, local_files_only=offline,
                                   tqdm_class=_stoppable_tqdm())
    except ModelSourceError:
        raise
    except Exception as e:
        raise map_error(uri, e, token_sent=token is not None, offline=offline) from e
    if not offline and uri.revision != sha:
        _write_ref(hf_cache, uri.repo_id, uri.revision, sha)
    return weights_path(Path(folder), selected), sha, [Path(folder) / f for f in selected]


def _lfs_files(uri: ModelURI, siblings: list) -> dict[str, tuple[str, int]]:
    """Repository path -> (sha256, size in bytes) of the LFS files in a ``files_metadata`` listing.
    A sha256 that is not 64 hex digits (it becomes a file name) leaves its file to huggingface_hub,
    with a warning: its bytes are checked for size only."""
    out = {}
    for s in siblings:
        if s.lfs is None:
            continue
        digest = str(s.lfs.sha256).lower()
        if _SHA256.match(digest):
            out[s.rfilename] = (digest, int(s.lfs.size))
        else:
            log.warning("%s: the Hub lists %s with sha256 %r, not 64 hex digits; its checksum is not checked",
                        uri.text, s.rfilename, s.lfs.sha256)
    return out


class _Stopped(Exception):
    """A blob download stopped because another one of the same fetch failed."""


def _fetch_blobs(uri: ModelURI, hf_cache: Path, sha: str, lfs: dict[str, tuple[str, int]], *,
                 endpoint: str | None, token: str | None) -> None:
    """Download the LFS files ``lfs`` (repository path -> (sha256 hex, size in bytes)) of commit
    ``sha`` that are not yet in ``hf_cache``'s blobs folder, :data:`MAX_WORKERS` at a time, each
    resumed and checked as the module docstring says. On the first failure the others stop at their
    next chunk (their partial files stay, to be resumed).

    Raises:
        ModelSourceError: reason ``ChecksumMismatch`` (the file is deleted), or ``Unreachable`` (the
            body ended early or could not be resumed; trying again resumes or restarts it).
        Interrupted: :func:`.cancel.cancel_fetches` was called.
        HfHubHTTPError, httpx2.TransportError, OSError: for :func:`map_error`.
    """
    blobs = hf_cache / f"models--{uri.repo_id.replace('/', '--')}" / "blobs"
    todo = {f: v for f, v in lfs.items() if not (blobs / v[0]).is_file()}
    if not todo:
        return
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    headers = build_hf_headers(token=token)  # None: a saved login, as snapshot_download
    blobs.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=min(MAX_WORKERS, len(todo)), thread_name_prefix="hf-blob") as pool:
        futures = [pool.submit(_fetch_blob, uri, f, hf_hub_url(uri.repo_id, f, revision=sha, endpoint=endpoint),
                               headers, blobs / digest, digest, size, hf_cache / ".locks" / blobs.parent.name, stop)
                   for f, (digest, size) in sorted(todo.items())]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:  # a failure, or a signal raised in this thread: the others stop at their next chunk
            stop.set()
    errors = [f.exception() for f in futures if f.exception() is not None and not isinstance(f.exception(), _Stopped)]
    if errors:
        raise next((e for e in errors if isinstance(e, Interrupted)), errors[0])


def _fetch_blob(uri: ModelURI, filename: str, url: str, headers: dict[str, str], blob: Path, expected: str,
                size: int, locks: Path, stop: threading.Event) -> None:
    """Download one LFS file (``size`` bytes, sha256 ``expected``) from ``url`` to ``blob``, resuming
    ``blob.incomplete``; under huggingface_hub's own lock for that blob (``.locks/models--…/<sha256>.lock``),
    so that it and we never write the same file at once."""
    from filelock import FileLock, Timeout

    def check() -> None:
        check_cancelled()
        if stop.is_set():
            raise _Stopped

    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"{expected}.lock"), mode=0o664)
    while True:  # in short waits, so that a signal or a failed sibling stops the wait too
        check()
        try:
            lock.acquire(timeout=1)
            break
        except Timeout:
            continue
    try:
        if blob.is_file():  # another process finished it while we waited
            return
        partial = blob.with_name(blob.name + ".incomplete")
        digest = hashlib.sha256()
        have = partial.stat().st_size if partial.is_file() else 0
        if have > size:
            partial.unlink()
            have = 0
        with partial.open("ab") as out:
            if have:
                with partial.open("rb") as prefix:  # the hash of what an earlier try wrote
                    while chunk := prefix.read(CHUNK_BYTES):
                        check()
                        digest.update(chunk)
            if have < size:
                digest, have = _stream(uri, filename, url, headers, have, out, digest, check)
        if have < size:
            raise ModelSourceError(f"model {uri.text!r}: the download of {filename} ended after {have} of {size} "
                                   "bytes; trying again resumes it", reason="Unreachable")
        got = digest.hexdigest()
        if have != size or got != expected:
            partial.unlink(missing_ok=True)
            raise ModelSourceError(
                f"model {uri.text!r}: {filename} of {uri.repo_id} does not match the Hub's checksum: sha256 expected "
                f"{expected} ({size} bytes), got {got} ({have} bytes); the file is deleted, so fetching again "
                "downloads it anew (if it fails again, a proxy or mirror on the way serves other bytes)",
                reason="ChecksumMismatch")
        os.replace(partial, blob)
    finally:
        lock.release()


def _stream(uri: ModelURI, filename: str, url: str, headers: dict[str, str], have: int, out, digest,
            check) -> tuple:
    """GET ``url`` from byte ``have`` on (redirects followed: the token does not go to the CDN, a
    different origin) into ``out`` (the partial file, opened for appending), updating ``digest``;
    returns the digest and the bytes now in the file. A server that ignores the Range header
    (200) starts the file over; one that refuses it (416) or answers another range gets the
    partial file emptied and an ``Unreachable`` error, so the next try starts over."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session, hf_raise_for_status

    request_headers = {**headers, "Range": f"bytes={have}-"} if have else headers
    with get_session().stream("GET", url, headers=request_headers, follow_redirects=True,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
        if have and (r.status_code == 416 or (r.status_code == 206 and not r.headers.get(
                "Content-Range", "").startswith(f"bytes {have}-"))):
            out.truncate(0)
            raise ModelSourceError(f"model {uri.text!r}: the Hub would not resume {filename} at byte {have} "
                                   f"(HTTP {r.status_code}); its partial file is emptied and the next try starts "
                                   "it over", reason="Unreachable", status=r.status_code)
        hf_raise_for_status(r)
        if have and r.status_code == 200:  # the Range was ignored: the body is the whole file
            log.info("%s: the server ignored the Range request for %s; downloading it from the start", uri.text,
                     filename)
            out.truncate(0)
            digest, have = hashlib.sha256(), 0
        elif have:
            log.info("%s: resuming %s at byte %d", uri.text, filename, have)
        bar = progress_bar(filename, have + int(r.headers.get("Content-Length") or 0) or None, have)
        try:
            for chunk in r.iter_bytes(chunk_size=CHUNK_BYTES):
                check()
                out.write(chunk)
                digest.update(chunk)
                have += len(chunk)
                bar.update(len(chunk))
        finally:
            bar.close()
    return digest, have


@functools.cache
def _stoppable_tqdm() -> type:
    """huggingface_hub's progress bar class with a cancellation check in ``update`` (called per
    chunk by every download thread, and per finished file), so that a fetch stops at its next
    chunk. Disabled bars still call it."""
    from huggingface_hub.utils import tqdm

    class StoppableTqdm(tqdm):
        def update(self, n=1):
            check_cancelled()
            return super().update(n)

    return StoppableTqdm


def _write_ref(hf_cache: Path, repo_id: str, revision: str, sha: str) -> None:
    """Record ``revision`` -> ``sha`` as huggingface_hub does (``refs/<revision>`` holding the sha),
    so an offline start resolves the branch from the cache."""
    ref = hf_cache / f"models--{repo_id.replace('/', '--')}" / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == sha:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(ref, sha)
    except OSError as e:
        log.warning("could not record %s -> %s in %s: %s", revision, sha, ref, e)


def _cached_listing(uri: ModelURI, hf_cache: Path) -> tuple[str, list[str]]:
    """Commit sha and file list of ``uri`` from the cache alone: the tree listing huggingface_hub
    saved, else the files present in the snapshot folder."""
    storage = hf_cache / f"models--{uri.repo_id.replace('/', '--')}"
    sha = uri.revision
    ref = storage / "refs" / uri.revision
    if ref.is_file():
        sha = ref.read_text().strip()
    snapshot = storage / "snapshots" / sha
    if not snapshot.is_dir():
        raise ModelSourceError(
            f"model {uri.text!r}: offline, and {hf_cache} holds no snapshot of {uri.repo_id}@{uri.revision}; fetch "
            "it once online or mount a cache that has it",
            reason="NotCached")
    try:
        from huggingface_hub import get_cached_repo_tree  # 2.x: the listing saved beside the snapshot

        files = [f.path for f in get_cached_repo_tree(uri.repo_id, revision=sha, cache_dir=hf_cache)]
    except Exception:  # older huggingface_hub, or a cache it did not write
        files = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    return sha, files


def retry_after_s(headers) -> int | None:
    """Seconds a 429's headers ask to wait: ``Retry-After`` (delay-seconds; an HTTP date is not
    read, as in huggingface_hub), else the IETF ``RateLimit`` header's ``t`` when ``r=0`` (what the
    Hub sends); None without either."""
    value = (headers.get("Retry-After") or "").strip()
    if value.isdigit():
        return int(value)
    try:
        from huggingface_hub.utils import parse_ratelimit_headers
    except ImportError:  # huggingface_hub before 1.x
        return None
    info = parse_ratelimit_headers(headers)
    return info.reset_in_seconds if info is not None and info.remaining == 0 else None


def _http_cause(e: BaseException | None):
    """The first HfHubHTTPError in ``e``'s chain of causes (huggingface_hub wraps a failed HEAD of
    a file in a LocalEntryNotFoundError), or None."""
    from huggingface_hub.errors import HfHubHTTPError

    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, HfHubHTTPError):
            return e
        e, seen = e.__cause__, seen + 1
    return None


INVALID_TOKEN = "Invalid credentials in Authorization header"  # the Hub's X-Error-Message for a bad token


def map_error(uri: ModelURI, e: Exception, *, token_sent: bool, offline: bool = False) -> ModelSourceError:
    """The :class:`ModelSourceError` of a huggingface_hub or httpx error: the message names the
    model, the HTTP status and what to do. A 429 is ``RateLimited`` (retried, with its
    ``retry_after`` in seconds); a 401 for an invalid or expired token is ``Unauthorized`` and says so."""
    try:
        from httpx2 import TransportError  # huggingface_hub 2.x
    except ImportError:
        from httpx import TransportError  # huggingface_hub 1.x
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if (cause := _http_cause(e)) is not None and cause.response is not None and \
            cause.response.status_code == 429:
        e = cause  # a rate-limited HEAD that huggingface_hub reported as a missing local file
    status = getattr(getattr(e, "response", None), "status_code", None)
    where = f"model {uri.text!r}" + (f": HTTP {status}" if status else "")
    token_hint = "check that HF_TOKEN (or spec.model.secretRef) holds a valid token" if token_sent else \
        "set HF_TOKEN or spec.model.secretRef"
    if isinstance(e, GatedRepoError):
        return ModelSourceError(
            f"{where}: {uri.repo_id} is a gated repository: accept its terms on the Hub with the account of your token "
            f"and {token_hint}", reason="GatedRepo", status=status)
    if isinstance(e, RevisionNotFoundError):
        return ModelSourceError(f"{where}: {uri.repo_id} has no revision {uri.revision!r} (a branch, tag or commit sha)",
                                reason="RevisionNotFound", status=status)
    if isinstance(e, RepositoryNotFoundError):
        return ModelSourceError(f"{where}: no repository {uri.repo_id} on the Hub, or it is private: check the name, "
                                f"or {token_hint}", reason="NotFound", status=status)
    if isinstance(e, RemoteEntryNotFoundError):
        return ModelSourceError(f"{where}: a file of {uri.repo_id}@{uri.revision} is missing on the Hub",
                                reason="NotFound", status=status)
    if isinstance(e, LocalEntryNotFoundError) and (offline or isinstance(e.__cause__, OfflineModeIsEnabled)):
        return ModelSourceError(f"{where}: offline, and the cache holds no complete copy of {uri.repo_id}@"
                                f"{uri.revision} ({e}); fetch it once online",
                                reason="NotCached")
    if isinstance(e, HfHubHTTPError) and status == 429:
        wait_s = retry_after_s(e.response.headers)
        return ModelSourceError(
            f"{where}: the Hub rate-limits this client" + (f" (Retry-After: {wait_s} s)" if wait_s is not None else "")
            + "; it is tried again after the wait" + ("" if token_sent else
                                                      "; requests with a token (HF_TOKEN) get higher limits"),
            reason="RateLimited", status=status, retry_after=wait_s)
    server_message = (e.response.headers.get("X-Error-Message") or getattr(e, "server_message", None) or "") \
        if isinstance(e, HfHubHTTPError) and e.response is not None else ""
    if isinstance(e, HfHubHTTPError) and status == 401 and INVALID_TOKEN in server_message:
        return ModelSourceError(
            f"{where}: the Hub rejected the token for {uri.repo_id} as invalid or expired ({INVALID_TOKEN}): "
            + ("put a valid one in HF_TOKEN (or spec.model.secretRef), or unset it for a public repository"
               if token_sent else "the saved login (hf auth login) holds it: log in again, run `hf auth logout` "
               "for a public repository, or set HF_TOKEN"),
            reason="Unauthorized", status=status)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return ModelSourceError(f"{where}: the Hub refused the request: {token_hint}", reason="Unauthorized",
                                status=status)
    if isinstance(e, HfHubHTTPError) and status == 404:
        return ModelSourceError(f"{where}: not found on the Hub", reason="NotFound", status=status)
    if isinstance(e, (TransportError, LocalEntryNotFoundError, OfflineModeIsEnabled)) or \
            (isinstance(e, HfHubHTTPError) and (status or 500) >= 500):
        endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        return ModelSourceError(f"{where}: cannot reach the Hub at {endpoint} ({type(e).__name__}: {e}); check the "
                                "network, a proxy (HTTPS_PROXY) or HF_ENDPOINT", reason="Unreachable", status=status)
    if isinstance(e, OSError) and not isinstance(e, TransportError):  # the cache: full, read-only, not ours
        return ModelSourceError(f"model {uri.text!r}: cannot write the model cache: {type(e).__name__}: {e}",
                                reason="CacheNotWritable")
    return ModelSourceError(f"{where}: {type(e).__name__}: {e}", reason="InvalidURI", status=status)
