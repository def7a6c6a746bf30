"""A request body in a content coding this process cannot decode: a 415 before it is read.

aiohttp decodes a request body whose ``Content-Encoding`` is exactly one of gzip, deflate, br (with
the Brotli package) or zstd (with a zstd module), and passes any other body on undecoded: an
unknown coding (``compress``, a typo) reached the JSON parser as whatever bytes it was, and two
stacked codings (``gzip, gzip``, or two header lines) were decoded once and failed as bad JSON.
RFC 9110 §15.5.16 has the answer: 415 with ``Accept-Encoding`` naming the codings accepted. The server's and the
gateway's error middlewares call :func:`refuse_undecodable_coding` after the size check.

br or zstd without its package never gets here: aiohttp refuses it while parsing the headers
(a plain-text 400, logged as one line by :mod:`.parse_errors`).
"""
from __future__ import annotations

from aiohttp import hdrs, web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD

UNSUPPORTED_CODING_CODE = "unsupported_content_encoding"  # the 415's error code, server and gateway
# What aiohttp decodes in this process, in the order a client would best pick them.
DECODED_CODINGS = ("gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())


def refuse_undecodable_coding(request: web.Request) -> None:
    """Raises ``web.HTTPUnsupportedMediaType`` (415, ``Accept-Encoding`` listing
    :data:`DECODED_CODINGS`) for a request with a body whose ``Content-Encoding`` is neither
    ``identity`` nor one coding aiohttp decodes here. Case and surrounding blanks are ignored, as
    aiohttp ignores them; two header lines are two codings (RFC 9110 §5.3), as in one line; a
    request without a body passes whatever it declares, and one no route takes keeps its 404 or
    405."""
    lines = request.headers.getall(hdrs.CONTENT_ENCODING, ())
    if not lines or not request.body_exists or request.match_info.http_exception is not None:
        return
    declared = ", ".join(lines)
    coding = declared.strip().lower()
    if coding in ("", "identity") or coding in DECODED_CODINGS:
        return
    accepted = ", ".join(DECODED_CODINGS)
    raise web.HTTPUnsupportedMediaType(
        text=f"Content-Encoding {declared.strip()[:40]!r} is not accepted: send the body uncompressed or in one "
             f"of {accepted}.",
        headers={hdrs.ACCEPT_ENCODING: accepted})
