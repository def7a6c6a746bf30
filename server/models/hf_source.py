"""Fetch a Hugging Face Hub model with huggingface_hub into its standard cache layout.

Only what the loader reads comes down: ``*.safetensors`` or the chosen ``*.gguf``, the config
and generation config, tokenizer files and chat templates; pickles (``*.bin``, ``*.pt``, …) never.

A download stops at its next chunk once :func:`.sources.cancel_fetches` is called: the check
rides on the progress bar class huggingface_hub lets a caller pass (``tqdm_class``), whose
``update`` every download thread calls per chunk. huggingface_hub reads 10 MiB chunks (80 s on a
1 Mbit/s link, past a pod's 30 s grace period), so this module lowers its
``constants.DOWNLOAD_CHUNK_SIZE`` (read at each request) to :data:`CHUNK_BYTES`. huggingface_hub 1.18 and later write each try
to a file of its own (``blobs/<etag>.<nonce>.incomplete``) and never resume one, so a download
that is killed leaves that file behind and the next one starts the file over; the cache's
eviction removes such files (:func:`.model_cache.evict`).
"""
from __future__ import annotations

import fnmatch
import functools
import logging
import os
import sys
from pathlib import Path

from .disk_cache import write_atomic
from .sources import ModelSourceError, ModelURI, check_cancelled, several_ggufs, weights_path

log = logging.getLogger("slipstream.sources")

CHUNK_BYTES = 1 << 20  # bytes between cancellation checks (and progress updates) of a Hub download

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
        ModelSourceError: see :func:`map_error`.
        Interrupted: :func:`.sources.cancel_fetches` was called.
    """
    import huggingface_hub.constants
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not sys.stderr.isatty():  # pod logs get sources.py's progress lines, not bars redrawn with \r
        disable_progress_bars()
    endpoint = os.environ.get("HF_ENDPOINT") or None  # huggingface_hub reads it only once, at import
    token = os.environ.get("HF_TOKEN") or None
    try:
        if offline:
            sha, files = _cached_listing(uri, hf_cache)
        else:
            info = HfApi(endpoint=endpoint, token=token).model_info(uri.repo_id, revision=uri.revision)
            sha, files = info.sha, [s.rfilename for s in info.siblings or []]
        selected = select_files(uri, files)
        log.info("%s: revision %s, %d files: %s", uri.text, sha, len(selected), ", ".join(selected))
        huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE = min(huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE, CHUNK_BYTES)
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


def map_error(uri: ModelURI, e: Exception, *, token_sent: bool, offline: bool = False) -> ModelSourceError:
    """The :class:`ModelSourceError` of a huggingface_hub or httpx error: the message names the
    model, the HTTP status and what to do."""
    try:
        from httpx2 import TransportError  # huggingface_hub 2.x
    except ImportError:
        from httpx import TransportError  # huggingface_hub 1.x
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

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
