"""The model URI as a server reads it, into a :class:`ModelURI`.

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
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelSourceError

SCHEMES = ("builtin", "sim", "local", "hf", "s3")
ACCEPTED_FORMS = ("builtin, sim:PROFILE, a local path (a .gguf file or a checkpoint directory), "
                  "hf://ORG/NAME[@REVISION][:FILE], ORG/NAME[@REVISION][:FILE], s3://BUCKET/PREFIX")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


def served_name(model: str) -> str | None:
    """The name a model is served under by default: ``ORG/NAME`` for Hugging Face models; None
    where the loader's own name (file or directory name) applies."""
    try:
        uri = parse_model_uri(model)
    except ModelSourceError:
        return None
    return uri.repo_id if uri.scheme == "hf" else None
