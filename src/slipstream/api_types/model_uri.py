"""The model URI grammar: which weights a URI names, parsed into its parts. One grammar for
``spec.model.uri`` (the operator) and ``slipstream serve --model`` / ``slipstream download`` (the
server); each says which forms it takes (:data:`SPEC_SCHEMES`, :data:`SERVER_SCHEMES`).

=======================================  ============================================================
``builtin``                              the packaged SmolLM2-135M-Instruct GGUF
``sim:PROFILE[,key=value...]``           the simulator (no weights); :data:`SIM_PROFILE` is the shape
                                         of ``PROFILE``, the simulator checks the names and values
``hf://ORG/NAME[@REVISION][:FILE]``      a Hugging Face Hub repository; ``REVISION`` a branch, tag or
                                         commit sha (default ``main``); ``FILE`` picks files of a
                                         repository holding many quantizations: a glob
                                         (``*Q4_K_M.gguf``) or a quantization tag (``Q4_K_M``,
                                         case-insensitive, meaning ``*Q4_K_M*.gguf``)
``ORG/NAME[@REVISION][:FILE]``           the same
``s3://BUCKET/PREFIX``                   the objects under ``PREFIX/`` (or the one object ``PREFIX``)
``oci://REGISTRY/REPOSITORY[:TAG|@D]``   a model image (its files under ``/models``); ``D`` is
                                         ``sha256:`` and 64 hex digits
``pvc://CLAIM/PATH``                     ``PATH`` on the PersistentVolumeClaim ``CLAIM``, relative to
                                         its root, without ``..``
a local path (``local_paths=True``)      ``/abs``, ``./rel``, ``../rel``, ``~/x``, ``file://PATH``, or a
                                         name that is not ``ORG/NAME``
=======================================  ============================================================

The file selector follows ``:`` because neither a repository id nor a git ref name
(``git check-ref-format``) may contain one, so it never collides with the name or the revision.
Pure: no file system and no network (whether a local path exists is the server's question).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

SCHEMES = ("builtin", "sim", "local", "hf", "s3", "oci", "pvc")
SPEC_SCHEMES = ("hf", "s3", "oci", "pvc", "builtin", "sim")  # spec.model.uri
SERVER_SCHEMES = ("builtin", "sim", "local", "hf", "s3")  # serve --model, download
FORMS = {
    "builtin": "builtin",
    "sim": "sim:PROFILE",
    "local": "a local path (a .gguf file or a checkpoint directory)",
    "hf": "hf://ORG/NAME[@REVISION][:FILE] (or ORG/NAME[@REVISION][:FILE])",
    "s3": "s3://BUCKET/PREFIX",
    "oci": "oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]",
    "pvc": "pvc://CLAIM/PATH",
}

# A simulator profile's name, optionally followed by its options (server/sim/backend.py reads them).
SIM_PROFILE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(,(time_scale|output_len|seed|load_seconds)=[-+.0-9eE]+)*$")
# A Hub repository id: letters, digits, '-', '_', '.', each part starting with a letter or digit;
# huggingface_hub checks the finer rules.
HF_REPO = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9]{0,95}/[A-Za-z0-9][-_.A-Za-z0-9]{0,95}$")
# A revision (branch, tag or commit) or a file glob: no '@', ':' or whitespace.
HF_PART = re.compile(r"^[^@:\s]{1,255}$")
# An S3 bucket name: 3-63 lowercase letters, digits, '.' and '-'.
S3_BUCKET = re.compile(r"^[a-z0-9][-.a-z0-9]{1,61}[a-z0-9]$")
# A PersistentVolumeClaim name (a DNS-1123 subdomain).
PVC_CLAIM = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
# An image reference: a registry host (with a port, or a dot, or localhost), a repository, and a
# tag or a digest.
OCI_REFERENCE = re.compile(r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?(:[0-9]{1,5})?/[a-z0-9]+([._/-][a-z0-9]+)*"
                           r"(:[A-Za-z0-9_][-.A-Za-z0-9_]{0,127}|@sha256:[0-9a-f]{64})?$")



def _body(pattern: re.Pattern[str]) -> str:
    """``pattern``'s text without its ``^`` and ``$`` anchors, to compose a larger pattern."""
    return pattern.pattern.removeprefix("^").removesuffix("$")


# The API server's check of ``spec.model.uri`` (the CRD's ``pattern``), one alternative per form of
# :data:`SPEC_SCHEMES`, built from the regexes above; :func:`parse` gives the precise message.
SPEC_URI_PATTERN = "|".join((
    rf"^(hf://)?{_body(HF_REPO)}(@{_body(HF_PART)})?(:{_body(HF_PART)})?$",
    rf"^s3://{_body(S3_BUCKET)}(/\S*)?$",
    rf"^oci://{_body(OCI_REFERENCE)}$",
    rf"^pvc://{_body(PVC_CLAIM)}(/\S*)?$",
    r"^builtin$",
    rf"^sim:{_body(SIM_PROFILE)}$",
))

def forms(schemes: Iterable[str]) -> str:
    """The accepted forms of ``schemes`` (keys of :data:`FORMS`), for error messages."""
    return ", ".join(FORMS[s] for s in schemes)


class ModelURIError(ValueError):
    """A text that is not a model URI. ``text``: as given; ``why``: what is wrong with it, to be
    prefixed by the caller's name for the field (``spec.model.uri 'x': ...``)."""

    def __init__(self, text: str, why: str):
        super().__init__(f"model URI {text!r}: {why}")
        self.text, self.why = text, why


@dataclass(frozen=True)
class ModelURI:
    """A parsed model URI; only the fields of its ``scheme`` (one of :data:`SCHEMES`) are set.
    ``text``: as given."""

    scheme: str
    text: str
    path: str | None = None  # local: as given; pvc: relative to the claim's root, "" for the root
    profile: str | None = None  # sim: everything after "sim:"
    repo_id: str | None = None  # hf
    revision: str = "main"  # hf
    filename: str | None = None  # hf: a glob choosing files
    bucket: str | None = None  # s3
    prefix: str | None = None  # s3, without a leading or trailing "/"
    claim: str | None = None  # pvc
    reference: str | None = None  # oci: REGISTRY/REPOSITORY[:TAG|@DIGEST]

    @property
    def identity(self) -> str:
        """The canonical URI (what the model cache locks and records; what the operator passes on)."""
        if self.scheme == "hf":
            return f"hf://{self.repo_id}@{self.revision}" + (f":{self.filename}" if self.filename else "")
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}"
        return self.text


def parse_model_uri(text: str, *, local_paths: bool = False) -> ModelURI:
    """Parse ``text`` (forms in the module docstring) into a :class:`ModelURI`.

    Args:
        local_paths: whether a local path is a form here (the server's ``--model``); without it a
            path, ``file://`` and any other text are errors (``spec.model.uri``).

    Raises:
        ModelURIError: with ``why`` saying what is wrong.
    """
    if not text or not text.strip():
        raise ModelURIError(text, "empty")
    if text == "builtin":
        return ModelURI("builtin", text)
    if text.startswith("sim:"):
        profile = text[4:]
        if not SIM_PROFILE.match(profile):
            raise ModelURIError(text, "the profile must be a name such as tiny or llama3-8b-h100, optionally "
                                      "followed by ,time_scale=S ,output_len=N|A-B ,seed=N ,load_seconds=S")
        return ModelURI("sim", text, profile=profile)
    scheme, sep, rest = text.partition("://")
    if sep:
        if scheme == "hf":
            return _parse_hf(text, rest)
        if scheme == "s3":
            return _parse_s3(text, rest)
        if scheme == "oci":
            if not OCI_REFERENCE.match(rest):
                raise ModelURIError(text, "an OCI URI is oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST], lowercase, "
                                          "with the registry's host (and port)")
            return ModelURI("oci", text, reference=rest)
        if scheme == "pvc":
            return _parse_pvc(text, rest)
        if scheme == "file" and local_paths:
            if not rest:
                raise ModelURIError(text, "file:// names no path")
            return ModelURI("local", text, path=rest)
        raise ModelURIError(text, f"scheme {scheme}:// is not supported")
    if local_paths and text.startswith(("/", "./", "../", "~")):
        return ModelURI("local", text, path=text)
    if HF_REPO.match(re.split(r"[@:]", text, maxsplit=1)[0]):
        return _parse_hf(text, text)
    if local_paths:
        return ModelURI("local", text, path=text)
    raise ModelURIError(text, "not a model URI")


def _parse_hf(text: str, rest: str) -> ModelURI:
    name_rev, colon, selector = rest.partition(":")
    repo_id, at, revision = name_rev.partition("@")
    if not HF_REPO.match(repo_id) or ".." in repo_id or repo_id.startswith(("datasets/", "spaces/")):
        raise ModelURIError(text, f"{repo_id!r} is not a Hugging Face model id (ORG/NAME)")
    if at and not revision:
        raise ModelURIError(text, "empty revision after '@'")
    if colon and not selector:
        raise ModelURIError(text, "empty file selector after ':' (e.g. :Q4_K_M or :*q8_0.gguf)")
    if (at and not HF_PART.match(revision)) or (colon and not HF_PART.match(selector)):
        raise ModelURIError(text, "one '@REVISION' and one ':FILE' at most, without spaces, 255 characters each")
    return ModelURI("hf", text, repo_id=repo_id, revision=revision or "main",
                    filename=_glob(selector) if selector else None)


def _glob(selector: str) -> str:
    """A glob as given; a bare quantization tag as ``*TAG*.gguf`` matching either case."""
    if any(c in selector for c in "*?[") or "." in selector:
        return selector
    return "*" + "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in selector) + "*.gguf"


def _parse_s3(text: str, rest: str) -> ModelURI:
    bucket, _, prefix = rest.partition("/")
    if not S3_BUCKET.match(bucket):
        raise ModelURIError(text, f"{bucket!r} is not an S3 bucket name: an S3 URI is s3://BUCKET/PREFIX with a "
                                  "bucket name of 3-63 lowercase letters, digits, '.' and '-'")
    if any(c.isspace() for c in prefix):
        raise ModelURIError(text, "an S3 prefix has no spaces")
    return ModelURI("s3", text, bucket=bucket, prefix=prefix.strip("/"))


def _parse_pvc(text: str, rest: str) -> ModelURI:
    claim, _, path = rest.partition("/")
    path = path.strip("/")
    if not PVC_CLAIM.match(claim) or any(c.isspace() for c in path) or ".." in path.split("/"):
        raise ModelURIError(text, "a PVC URI is pvc://CLAIM/PATH, CLAIM a PersistentVolumeClaim in the service's "
                                  "namespace, PATH relative to its root without '..'")
    return ModelURI("pvc", text, path=path, claim=claim)
