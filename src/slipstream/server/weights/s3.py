"""Fetch the objects under an S3 prefix with boto3 (AWS S3 or any S3-compatible store).

Endpoint: the ``endpoint`` argument, else ``$AWS_ENDPOINT_URL``; region ``$AWS_REGION``;
credentials as boto3 finds them (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, a profile, a pod's web identity). Each file is downloaded to a
``.partial`` file named after its ETag, resumed with a ranged GET if one is there, and renamed
into place when its size is right and its content checks out as a whole (resumed or not): against
the object's full-object checksum (``HeadObject`` with ``ChecksumMode=ENABLED``: SHA-512, SHA-256,
SHA-1, MD5, CRC64NVME and CRC32C with awscrt installed, CRC32), else against the ETag when it is
an MD5 (one part, no SSE-KMS or SSE-C); a multipart object without a full-object checksum is
checked by size only. A mismatch deletes the file and raises reason ``ChecksumMismatch``.
``.slipstream-s3.json`` records each file's ETag and size, so a file whose object has not changed
is never downloaded again. A download that is killed or
interrupted (:func:`.cancel.cancel_fetches`, checked every 1 MiB chunk) keeps its ``.partial``
file, which the next fetch of the same object resumes.

What to load is decided from the listing, before anything is downloaded, by the rule the loader
applies to any folder (:func:`.files.weights_path`): a prefix holding several GGUF files and no
safetensors fails at once, naming them.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any, Callable

from .disk_cache import write_atomic
from .cancel import check_cancelled
from .endpoint import check_endpoint
from .errors import ModelSourceError
from .files import weights_path
from .progress import progress_bar
from .uri import ModelURI

log = logging.getLogger("slipstream.sources")

MANIFEST = ".slipstream-s3.json"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")
_CHUNK = 1 << 20
# The ModelSourceError reason of a download whose bytes do not match the object's checksum or MD5.
CHECKSUM_MISMATCH = "ChecksumMismatch"


def client(endpoint: str | None = None, model: str = "s3://"):
    """A boto3 S3 client for ``endpoint`` (default ``$AWS_ENDPOINT_URL``) in ``$AWS_REGION``, with
    botocore's standard retries (3 tries, on network errors, 5xx and throttling only). Raises
    ModelSourceError (``InvalidEndpoint``, naming ``model``) for an endpoint that is not a URL."""
    import boto3
    from botocore.config import Config

    endpoint = check_endpoint(endpoint, "the S3 endpoint (--s3-endpoint, spec.model.s3.endpoint)", model) or \
        check_endpoint(os.environ.get("AWS_ENDPOINT_URL") or None, "AWS_ENDPOINT_URL", model)
    return boto3.client(
        "s3", endpoint_url=endpoint,
        region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        # response checks when_required: botocore would hash each GET a second time (ours, in
        # _download, also covers ranged GETs, which carry no checksum)
        config=Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=10, read_timeout=60,
                      response_checksum_validation="when_required"))


def object_revision(objects: dict[str, tuple[str, int]]) -> str:
    """The revision of a listing ``{relative path: (etag, size)}``: sha256 of the sorted paths and
    ETags (hex), so any changed, added or removed object changes it."""
    text = "\n".join(f"{rel}\t{etag}" for rel, (etag, _) in sorted(objects.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def copy_folder(uri: ModelURI, s3_root: Path, path: Path | None = None) -> Path:
    """The folder :func:`fetch_s3` fills for ``uri`` under ``s3_root``: ``PREFIX/``, or ``PREFIX.d/``
    for a prefix that names one object, which ``path`` (a copy's load path) tells apart."""
    dest = s3_root / uri.bucket / (uri.prefix or "")
    single = dest.with_name(dest.name + ".d")
    return single if uri.prefix and path is not None and (path == single or single in path.parents) else dest


def copy_revision(folder: Path) -> str | None:
    """The revision (:func:`object_revision`) of what ``folder`` holds now, as its manifest records
    it: one copy per prefix, which a fetch after the objects changed rewrites in place. None
    without a manifest."""
    manifest = _read_manifest(folder)
    try:
        return object_revision({rel: (m["etag"], m["size"]) for rel, m in manifest.items()}) if manifest else None
    except (TypeError, KeyError, AttributeError):
        return None


def fetch_s3(uri: ModelURI, s3_root: Path, *, endpoint: str | None = None) -> tuple[Path, str, list[Path]]:
    """Bring ``s3://bucket/prefix`` into ``s3_root/bucket/prefix/``; returns the path to load, the
    revision (:func:`object_revision`) and the paths of the files fetched.

    Raises:
        ModelSourceError: see :func:`map_error`; ``NotFound`` when nothing lies under the prefix;
            ``InvalidURI`` for several GGUF files and no safetensors (before any download);
            ``ChecksumMismatch`` for a file whose bytes do not match its object (deleted; the
            files checked before it stay).
        Interrupted: :func:`.cancel.cancel_fetches` was called; the ``.partial`` file stays.
    """
    s3 = client(endpoint, uri.text)
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
    ETag (``If-Match`` makes a changed object start over), and check the whole file
    (:func:`_expected_digest`) before it is renamed into place.

    Raises:
        ModelSourceError: reason ``ChecksumMismatch`` (the ``.partial`` file deleted) when the
            bytes do not match; ``Unreachable`` when fewer bytes than the object's arrived.
    """
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
    try:
        # the whole object's checksum: a ranged GET returns none
        head = s3.head_object(Bucket=bucket, Key=key, IfMatch=f'"{etag}"', ChecksumMode="ENABLED")
        check = _expected_digest(head, etag)
        digest = check[1]() if check else None
        if digest is not None and have:
            _hash_file(partial, digest)
        if have < size:
            args = {"Bucket": bucket, "Key": key, "IfMatch": f'"{etag}"'}
            if have:
                args["Range"] = f"bytes={have}-"
                log.info("resuming %s at %.1f of %.1f MB", key, have / 1e6, size / 1e6)
            body = s3.get_object(**args)["Body"]
            bar = progress_bar(key.rsplit("/", 1)[-1], size, have)
            try:
                with open(partial, "ab") as f:
                    for chunk in body.iter_chunks(_CHUNK):
                        f.write(chunk)
                        bar.update(len(chunk))
                        if digest is not None:
                            digest.update(chunk)
                        check_cancelled()  # after the write: what arrived is kept for the resume
            finally:
                bar.close()
    except ClientError as e:
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (412, 416):
            partial.unlink(missing_ok=True)  # the object changed since it was listed
        raise
    got = partial.stat().st_size if partial.exists() else 0
    if got != size:
        raise ModelSourceError(f"s3://{bucket}/{key}: got {got} of {size} bytes; fetch again to resume",
                               reason="Unreachable")
    if check is not None:
        name, _, expected, encode = check
        actual = encode(digest.digest())
        if actual != expected:
            partial.unlink(missing_ok=True)  # never resumed: the bad bytes may be anywhere in it
            raise ModelSourceError(
                f"s3://{bucket}/{key}: {name} mismatch: expected {expected}, got {actual} over {size} bytes; "
                "the download was deleted (damaged in transit or on the store, or the object was rewritten "
                "in place); fetch again", reason=CHECKSUM_MISMATCH)
    else:
        log.info("s3://%s/%s: no full-object checksum and a multipart or encrypted ETag; checked by size only",
                 bucket, key)
    os.replace(partial, target)
    log.info("downloaded s3://%s/%s (%.1f MB)", bucket, key, size / 1e6)


class _Crc:
    """A CRC as a hashlib-like object (``update``, ``digest``: big-endian, as S3 encodes it)."""

    def __init__(self, step: Callable[[bytes, int], int], nbytes: int):
        self._step, self._nbytes, self._value = step, nbytes, 0

    def update(self, data: bytes) -> None:
        self._value = self._step(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(self._nbytes, "big")


def _algorithms() -> list[tuple[str, Callable[[], Any]]]:
    """(S3 checksum name, digest factory) that this process can compute, strongest first."""
    algorithms = [("SHA512", hashlib.sha512), ("SHA256", hashlib.sha256), ("SHA1", hashlib.sha1),
                  ("MD5", hashlib.md5)]
    try:
        from awscrt import checksums  # botocore's optional CRT extra
        algorithms += [("CRC64NVME", lambda: _Crc(checksums.crc64nvme, 8)),
                       ("CRC32C", lambda: _Crc(checksums.crc32c, 4))]
    except ImportError:
        pass
    return algorithms + [("CRC32", lambda: _Crc(zlib.crc32, 4))]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _expected_digest(head: dict, etag: str) -> tuple[str, Callable[[], Any], str, Callable[[bytes], str]] | None:
    """(what is checked, digest factory, expected value, encoding of a digest) for the object of
    ``head`` (a ``HeadObject`` answer with ``ChecksumMode=ENABLED``): its full-object checksum if
    it has one this process computes; else the ETag if it is an MD5 of the content (one part,
    neither SSE-KMS nor SSE-C, whose ETags are not); else None (size only)."""
    for name, factory in _algorithms():
        value = head.get(f"Checksum{name}")
        # "…-N", or ChecksumType COMPOSITE: a checksum of the parts' checksums, not of the bytes
        if value and "-" not in value and head.get("ChecksumType") != "COMPOSITE":
            return f"checksum {name}", factory, value, _b64
    encrypted = head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm")
    if re.fullmatch(r"[0-9a-f]{32}", etag) and not encrypted:
        return "ETag (MD5)", hashlib.md5, etag, bytes.hex
    return None


def _hash_file(path: Path, digest: Any) -> None:
    """Feed the bytes already in ``path`` (a resumed download) to ``digest``."""
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            check_cancelled()


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
