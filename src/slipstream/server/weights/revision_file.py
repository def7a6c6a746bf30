"""The revision file: what a pod's download step resolved (``slipstream download
--revision-file``), read back by its server (``serve --model-revision-file``) to pin its model."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelSourceError
from .uri import ModelURI, parse_model_uri

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
