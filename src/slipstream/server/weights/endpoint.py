"""The endpoint URL a Hub or S3 client is pointed at (``HF_ENDPOINT``, ``--s3-endpoint``), checked
before a client takes it."""
from __future__ import annotations

import urllib.parse

from .errors import ModelSourceError


def check_endpoint(url: str | None, what: str, model: str) -> str | None:
    """``url`` (None: the client's default) if it is an http(s) URL with a host; else a
    :class:`ModelSourceError` with reason ``InvalidEndpoint`` naming ``model`` and ``what`` set it (the
    clients raised a bare ValueError, or took it as a host name and said only that it was
    unreachable)."""
    if url is None:
        return None
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
