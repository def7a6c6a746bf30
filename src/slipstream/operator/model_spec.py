"""``spec.model``: which weights an InferenceService's pods load, and from where.

Two ways to name them, exclusive (the CRD's CEL rules say the same):

- ``uri``: ``hf://ORG/NAME[@REVISION][:FILE]`` (a bare ``ORG/NAME`` means the same),
  ``s3://BUCKET/PREFIX``, ``oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]``, ``pvc://CLAIM/PATH``,
  ``builtin`` or ``sim:PROFILE``. The Hub and S3 are downloaded by an init container
  (``slipstream download``) into the model cache (``spec.model.cache``); a PVC is mounted
  read-only; a model image (its files under ``/models``, KServe's modelcar layout) is mounted
  as an image volume, or on clusters without those through a modelcar sidecar. The grammar is
  :mod:`slipstream.api_types.model_uri`, which ``slipstream serve --model`` reads too.
- ``source`` (builtin | image | pvc | sim) with ``path``, ``claimName`` or ``profile``, as before
  ``uri`` existed. ``source: builtin``, which the API server used to default, may stay beside
  a ``uri``.

:func:`model_location` turns either into one :class:`ModelLocation`, which resources.py
renders; :func:`validate_model` checks what the CRD's schema checks, for servers and emulators
that do not.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kubernetes.utils.quantity import parse_quantity

from slipstream.api_types import model_uri
from slipstream.api_types.model import (MODEL_SOURCES, OCI_MOUNTS, ModelCacheSpec, ModelSpec,  # noqa: F401
                                        OCISpec, S3Spec, SecretRef)
from slipstream.api_types.model_uri import SIM_PROFILE, SPEC_SCHEMES  # noqa: F401

from .spec_error import SpecError

# ``auto`` mounts a model image as an image volume where the cluster has them (Kubernetes ≥ 1.35:
# on by default; GA in 1.36), else through a modelcar.
IMAGE_VOLUMES_SINCE = (1, 35)
# Where a model image keeps its files (KServe's modelcar convention).
MODEL_IMAGE_DIR = "/models"
# Sources that an init container downloads into the model cache before the server starts.
DOWNLOADED = ("hf", "s3")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$")
URI_FORMS = model_uri.forms(SPEC_SCHEMES)


def quantity_bytes(quantity: str | None) -> int | None:
    """A byte quantity (``"1Gi"``, ``spec.engine.kvCacheMemory``, ``spec.model.cache.maxSize``)
    as an int; None for None. Raises ValueError for a string that is not a quantity."""
    return None if quantity is None else int(parse_quantity(quantity))


@dataclass(frozen=True, slots=True)
class ModelLocation:
    """Where the weights are, whichever field named them. ``kind``: builtin | sim | image |
    pvc | hf | s3 | oci. ``path``: inside the image (image), relative to the claim's root (pvc,
    "" for the root). ``uri``: what ``slipstream download`` and ``serve --model`` get (hf, s3:
    normalized to the ``hf://`` form; builtin: ``builtin``; sim: ``sim:PROFILE``).
    ``reference``: the model image (oci)."""

    kind: str
    uri: str | None = None
    path: str | None = None
    claim_name: str | None = None
    profile: str | None = None
    reference: str | None = None

    @property
    def downloaded(self) -> bool:
        """Whether an init container fetches the weights into the model cache."""
        return self.kind in DOWNLOADED


def parse_uri(uri: str) -> ModelLocation:
    """``spec.model.uri`` as a :class:`ModelLocation` (:mod:`slipstream.api_types.model_uri`'s
    grammar, without local paths).

    Raises:
        SpecError: InvalidSpec naming what is wrong and the accepted forms (:data:`URI_FORMS`).
    """
    try:
        parsed = model_uri.parse_model_uri(uri)
    except model_uri.ModelURIError as e:
        raise SpecError("InvalidSpec", f"spec.model.uri {uri!r}: {e.why}; use one of {URI_FORMS}") from None
    if parsed.scheme == "hf":
        return ModelLocation("hf", uri=uri if uri.startswith("hf://") else f"hf://{uri}")
    if parsed.scheme == "s3":
        return ModelLocation("s3", uri=uri)
    if parsed.scheme == "oci":
        return ModelLocation("oci", uri=uri, reference=parsed.reference)
    if parsed.scheme == "pvc":
        return ModelLocation("pvc", uri=uri, path=parsed.path, claim_name=parsed.claim)
    if parsed.scheme == "sim":
        return ModelLocation("sim", uri=uri, profile=parsed.profile)
    return ModelLocation("builtin", uri="builtin")


def model_location(model: ModelSpec) -> ModelLocation:
    """The weights' :class:`ModelLocation` from ``uri`` or, without one, ``source`` and its
    fields. Call :func:`validate_model` first; this assumes a valid spec."""
    if model.uri is not None:
        return parse_uri(model.uri)
    if model.source == "sim":
        return ModelLocation("sim", uri=f"sim:{model.profile}", profile=model.profile)
    if model.source == "pvc":
        return ModelLocation("pvc", path=model.path.strip("/"), claim_name=model.claim_name)
    if model.source == "image":
        return ModelLocation("image", path=model.path)
    return ModelLocation("builtin", uri="builtin")


def validate_model(model: ModelSpec) -> None:
    """Raise SpecError (InvalidSpec) on the first rule of ``spec.model`` broken, in the CRD's
    words: ``uri`` exclusive with ``source`` (other than builtin), ``path``, ``claimName`` and
    ``profile``; each source's required and forbidden fields; the download fields only with a
    source that downloads."""
    if model.uri is not None:
        if model.source != "builtin" or model.path or model.claim_name or model.profile:
            raise SpecError("InvalidSpec", "spec.model.uri names the model on its own: remove "
                                           "source, path, claimName and profile (source: builtin, "
                                           "which older servers defaulted, may stay)")
        parse_uri(model.uri)
    else:
        _validate_source(model)
    location = model_location(model)
    needs = "spec.model.uri hf://… or s3://…"
    if not location.downloaded:
        for name, value in (("secretRef", model.secret_ref), ("cache", model.cache)):
            if value is not None:
                raise SpecError("InvalidSpec", f"spec.model.{name} configures the download step, "
                                               f"which only {needs} has")
    if location.kind != "s3" and model.s3 is not None:
        raise SpecError("InvalidSpec", "spec.model.s3 is only allowed with an s3:// uri")
    if location.kind != "oci" and model.oci is not None:
        raise SpecError("InvalidSpec", "spec.model.oci is only allowed with an oci:// uri")
    # The fields' own patterns and ranges were checked when the spec was parsed (api_types.model).
    if model.cache is not None and model.cache.claim_name is not None and model.cache.host_path is not None:
        raise SpecError("InvalidSpec", "spec.model.cache takes claimName or hostPath, not both")
    if model.cache is not None and model.cache.max_size is not None:
        try:
            size = parse_quantity(model.cache.max_size)
        except ValueError:
            size = None
        if size is None or size < 0:
            raise SpecError("InvalidSpec", f"spec.model.cache.maxSize must be a quantity ≥ 0 such "
                                           f"as '100Gi' (0 keeps only the revision in use), "
                                           f"got {model.cache.max_size!r}")


def _validate_source(model: ModelSpec) -> None:
    if model.source not in MODEL_SOURCES:
        raise SpecError("InvalidSpec", f"spec.model.source must be one of "
                                       f"{', '.join(MODEL_SOURCES)}, got {model.source!r}")
    if model.source in ("builtin", "sim") and (model.path or model.claim_name):
        why = ("use spec.model.uri, or source image or pvc, to load other weights"
               if model.source == "builtin" else "it loads no weights, its profile says what to simulate")
        raise SpecError("InvalidSpec", f"spec.model.source {model.source} takes no path or "
                                       f"claimName; {why}")
    if model.source not in ("builtin", "sim") and not model.path:
        raise SpecError("InvalidSpec", f"spec.model.path is required with source {model.source}")
    if (model.source == "sim") != bool(model.profile):
        raise SpecError("InvalidSpec", "spec.model.profile is required with source sim and only "
                                       "allowed with it")
    if model.source == "sim" and not SIM_PROFILE.match(model.profile):
        raise SpecError("InvalidSpec", f"spec.model.profile must be a profile name such as tiny or "
                                       f"llama3-8b-h100, optionally followed by ,time_scale=S "
                                       f",output_len=N|A-B ,seed=N ,load_seconds=S; got "
                                       f"{model.profile!r}")
    if model.source == "image" and not model.path.startswith("/"):
        raise SpecError("InvalidSpec", f"spec.model.path must be absolute with source image, "
                                       f"got {model.path!r}")
    if (model.source == "pvc") != bool(model.claim_name):
        raise SpecError("InvalidSpec", "spec.model.claimName is required with source pvc and "
                                       "only allowed with it")
    if model.source == "pvc" and (model.path.startswith("/") or ".." in model.path.split("/")):
        raise SpecError("InvalidSpec", f"spec.model.path must be relative to the volume's root "
                                       f"(no leading '/', no '..') with source pvc, "
                                       f"got {model.path!r}")


def needs_mount_probe(model: ModelSpec) -> bool:
    """Whether ``model`` is an ``oci://`` image whose mount is ``auto``: only then does the
    operator ask the API server whether it admits image volumes."""
    return (model.uri or "").startswith("oci://") and (model.oci or OCISpec()).mount == "auto"


def resolve_oci_mount(model: ModelSpec, kube_version: tuple[int, int] | None,
                      image_volumes: bool | None) -> ModelSpec:
    """``model`` with an ``auto`` image mount decided: ``image-volume`` where the API server
    admits image volumes (``image_volumes``: its dry run, see ``Kube.image_volumes_admitted``;
    a 1.33-1.34 cluster with the ImageVolume gate on admits them, a 1.35 one with it off does
    not), else ``modelcar``; when the dry run could not tell (None), by :func:`use_image_volume`'s
    version rule. Any other model comes back unchanged."""
    if not needs_mount_probe(model):
        return model
    volume = use_image_volume(model, kube_version) if image_volumes is None else image_volumes
    return model.model_copy(update={"oci": OCISpec(mount="image-volume" if volume else "modelcar")})


def use_image_volume(model: ModelSpec, kube_version: tuple[int, int] | None) -> bool:
    """Whether a model image is mounted as an image volume (else through a modelcar sidecar):
    as ``spec.model.oci.mount`` says, or for ``auto`` when the cluster is Kubernetes ≥ 1.35
    (``kube_version`` None: assume a current one)."""
    mount = (model.oci or OCISpec()).mount
    if mount != "auto":
        return mount == "image-volume"
    return kube_version is None or kube_version >= IMAGE_VOLUMES_SINCE
