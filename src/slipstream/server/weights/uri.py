"""The model URI as a server reads it (``--model``, ``LLM(model=...)``, ``slipstream download``):
the grammar of :mod:`slipstream.api_types.model_uri` with local paths, where a path that exists
always wins over the ``ORG/NAME`` form. ``pvc://`` and ``oci://`` belong to InferenceService
specs: the operator mounts them and the pod sees a path.
"""
from __future__ import annotations

from pathlib import Path

from slipstream.api_types import model_uri
from slipstream.api_types.model_uri import SERVER_SCHEMES, ModelURI

from .errors import ModelSourceError

ACCEPTED_FORMS = model_uri.forms(SERVER_SCHEMES)


def parse_model_uri(text: str) -> ModelURI:
    """Parse a model URI (forms in :mod:`slipstream.api_types.model_uri`; local paths allowed).

    Raises:
        ModelSourceError: reason ``InvalidURI``, with the accepted forms in the message.
    """
    if text and text.strip() and text != "builtin" and not text.startswith("sim:") and "://" not in text \
            and Path(text).expanduser().exists():
        return ModelURI("local", text, path=text)
    try:
        uri = model_uri.parse_model_uri(text, local_paths=True)
    except model_uri.ModelURIError as e:
        raise ModelSourceError(f"model {text!r}: {e.why}; accepted forms: {ACCEPTED_FORMS}",
                               reason="InvalidURI") from None
    if uri.scheme in ("pvc", "oci"):
        raise ModelSourceError(
            f"model {text!r}: {uri.scheme}:// models are for InferenceService specs (spec.model.uri): the operator "
            "mounts them into the pod, which sees a local path; here pass that path instead", reason="InvalidURI")
    return uri


def served_name(model: str) -> str | None:
    """The name a model is served under by default: ``ORG/NAME`` for Hugging Face models; None
    where the loader's own name (file or directory name) applies."""
    try:
        uri = parse_model_uri(model)
    except ModelSourceError:
        return None
    return uri.repo_id if uri.scheme == "hf" else None
