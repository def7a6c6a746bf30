"""Fetch the objects under an S3 prefix with boto3 (AWS S3 or any S3-compatible store).

Endpoint: the ``endpoint`` argument, else ``$AWS_ENDPOINT_URL``; region ``$AWS_REGION``;
credentials as boto3 finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, a profile, a pod's web identity). Each file is downloaded to a
``.partial`` file named after its ETag, resumed with a ranged GET if one is there, and renamed
into place when its size is right; ``.slipstream-s3.json`` records each file's ETag and size, so
a file whose object has not changed is never downloaded again. A download that is killed or
interrupted (:func:`.sources.cancel_fetches`, checked every 1 MiB chunk) keeps its ``.partial``
file, which the next fetch of the same object resumes.

What to load is decided from the listing, before anything is downloaded, by the rule the loader
applies to any folder (:func:`.sources.weights_path`): a prefix holding several GGUF files and no
safetensors fails at once, naming them.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
from pathlib import Path

from .disk_cache import write_atomic
from .sources import ModelSourceError, ModelURI, check_cancelled, weights_path

log = logging.getLogger("slipstream.sources")

MANIFEST = ".slipstream-s3.json"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
_CHUNK = 1 << 20


def client(endpoint: str | None = None):
    """A boto3 S3 client for ``endpoint`` (default ``$AWS_ENDPOINT_URL``) in ``$AWS_REGION``, with
    botocore's standard retries (3 tries, on network errors, 5xx and throttling only)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=endpoint or os.environ.get("AWS_ENDPOINT_URL") or None,
        region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60))


def object_revision(objects: dict[str, tuple[str, int]]) -> str:
    """The revision of a listing ``{relative path: (etag, size)}``: sha256 of the sorted paths and
    ETags (hex), so any changed, added or removed object changes it."""
    text = "\n".join(f"{rel}\t{etag}" for rel, (etag, _) in sorted(objects.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def fetch_s3(uri: ModelURI, s3_root: Path, *, endpoint: str | None = None) -> tuple[Path, str, list[Path]]:
    """Bring ``s3://bucket/prefix`` into ``s3_root/bucket/prefix/``; returns the path to load, the
    revision (:func:`object_revision`) and the paths of the files fetched.

    Raises:
        ModelSourceError: see :func:`map_error`; ``NotFound`` when nothing lies under the prefix;
            ``InvalidURI`` for several GGUF files and no safetensors (before any download).
        Interrupted: :func:`.sources.cancel_fetches` was called; the ``.partial`` file stays.
    """
    s3 = client(endpoint)
    try:
        objects, single = _list(s3, uri)
        dest = s3_root / uri.bucket / (uri.prefix or "")
        if single:  # the prefix names one object: keep it in a folder of its own name
            dest = dest.with_name(dest.name + ".d")
        ggufs = sorted(rel for rel in objects if rel.endswith(".gguf"))
        load = weights_path(dest, list(objects), model=uri.text,
                            example=f"s3://{uri.bucket}/{uri.prefix + '/' if uri.prefix else ''}{ggufs[0] if ggufs else ''}")
        dest.mkdir(parents=True, exist_ok=True)
        manifest = _read_manifest(dest)
        for rel, (etag, size) in sorted(objects.items()):
            key = uri.prefix if single else f"{uri.prefix}/{rel}" if uri.prefix else rel
            target = dest / rel
            if manifest.get(rel) == {"etag": etag, "size": size} and target.is_file() and \
                    target.stat().st_size == size:
                continue
            _download(s3, uri.bucket, key, etag, size, target)
            manifest[rel] = {"etag": etag, "size": size}
            _write_manifest(dest, manifest)
        for rel in set(manifest) - set(objects):  # deleted at the source: remove here too
            (dest / rel).unlink(missing_ok=True)
            del manifest[rel]
        _write_manifest(dest, manifest)
    except ModelSourceError:
        raise
    except Exception as e:
        raise map_error(uri, e, endpoint) from e
    return load, object_revision(objects), [dest / rel for rel in objects]


def _list(s3, uri: ModelURI) -> tuple[dict[str, tuple[str, int]], bool]:
    """``{path relative to the prefix: (etag, size)}`` of the objects to fetch, and whether the
    prefix is itself one object."""
    base = f"{uri.prefix}/" if uri.prefix else ""
    objects, skipped = {}, []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=uri.bucket, Prefix=base):
        for o in page.get("Contents", []):
            rel = o["Key"][len(base):]
            if not rel or rel.endswith("/"):  # folder markers some tools create
                continue
            if any(fnmatch.fnmatchcase(rel.rsplit("/", 1)[-1], p) for p in PICKLES):
                skipped.append(rel)
                continue
            objects[rel] = (o["ETag"].strip('"'), int(o["Size"]))
    if skipped:
        log.info("%s: not fetching pickle checkpoints (they can run code on load): %s", uri.text, ", ".join(skipped[:5]))
    if objects:
        return objects, False
    if uri.prefix:
        from botocore.exceptions import ClientError
        try:
            head = s3.head_object(Bucket=uri.bucket, Key=uri.prefix)
            return {uri.prefix.rsplit("/", 1)[-1]: (head["ETag"].strip('"'), int(head["ContentLength"]))}, True
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise
    raise ModelSourceError(f"model {uri.text!r}: no objects under s3://{uri.bucket}/{base}"
                           + (f" (only pickle checkpoints: {', '.join(skipped[:3])})" if skipped else "")
                           + "; check the bucket and the prefix", reason="NotFound", status=404)


def _download(s3, bucket: str, key: str, etag: str, size: int, target: Path) -> None:
    """Download one object to ``target``, resuming a ``.partial`` left by an earlier try of the same
    ETag (``If-Match`` makes a changed object start over)."""
    from botocore.exceptions import ClientError

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{hashlib.sha256(etag.encode()).hexdigest()[:12]}.partial")
    for stale in target.parent.glob(f"{target.name}.*.partial"):
        if stale != partial:
            stale.unlink(missing_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    if have < size:
        args = {"Bucket": bucket, "Key": key, "IfMatch": f'"{etag}"'}
        if have:
            args["Range"] = f"bytes={have}-"
            log.info("resuming %s at %.1f of %.1f MB", key, have / 1e6, size / 1e6)
        try:
            body = s3.get_object(**args)["Body"]
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (412, 416):
                partial.unlink(missing_ok=True)  # the object changed since it was listed
            raise
        with open(partial, "ab") as f:
            for chunk in body.iter_chunks(_CHUNK):
                f.write(chunk)
                check_cancelled()  # after the write: what arrived is kept for the resume
    got = partial.stat().st_size if partial.exists() else 0
    if got != size:
        raise ModelSourceError(f"s3://{bucket}/{key}: got {got} of {size} bytes; fetch again to resume",
                               reason="Unreachable")
    os.replace(partial, target)
    log.info("downloaded s3://%s/%s (%.1f MB)", bucket, key, size / 1e6)


def _read_manifest(dest: Path) -> dict:
    try:
        return json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _write_manifest(dest: Path, manifest: dict) -> None:
    write_atomic(dest / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def map_error(uri: ModelURI, e: Exception, endpoint: str | None = None) -> ModelSourceError:
    """The :class:`ModelSourceError` of a boto3/botocore error: the message names the model, the
    HTTP status and the S3 error code, and what to do."""
    from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError, NoCredentialsError,
                                     PartialCredentialsError, ReadTimeoutError)

    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
    creds_hint = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or spec.model.secretRef"
    if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
        return ModelSourceError(f"model {uri.text!r}: no S3 credentials: {creds_hint}", reason="Unauthorized")
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code", "")
        where = f"model {uri.text!r}: HTTP {status} {code}"
        if status in (401, 403) or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            return ModelSourceError(f"{where}: the store refused the credentials: {creds_hint} with keys that may "
                                    f"read s3://{uri.bucket}/{uri.prefix}", reason="Unauthorized", status=status)
        if status == 404 or code in ("NoSuchBucket", "NoSuchKey"):
            return ModelSourceError(f"{where}: check the bucket and the prefix", reason="NotFound", status=status)
        if status and status >= 500:
            return ModelSourceError(f"{where}: the store failed; trying again may help", reason="Unreachable",
                                    status=status)
        return ModelSourceError(f"{where}: {e}", reason="InvalidURI", status=status)
    if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionError)):
        return ModelSourceError(f"model {uri.text!r}: cannot reach {endpoint} ({e}); check the network, "
                                "AWS_ENDPOINT_URL or --s3-endpoint", reason="Unreachable")
    return ModelSourceError(f"model {uri.text!r}: {type(e).__name__}: {e}", reason="Unreachable")
