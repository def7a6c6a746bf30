"""``spec.model``: which weights an InferenceService's pods load, as the CRD declares it.

Two ways to name them, exclusive: ``uri`` (``hf://``, ``s3://``, ``oci://``, ``pvc://``,
``builtin``, ``sim:PROFILE``), or ``source`` (builtin | image | pvc | sim) with ``path``,
``claimName`` or ``profile``. The fields, their patterns and the CEL rules between them are here;
the operator's ``validate_model`` (``slipstream.operator.model_spec``) checks the same rules with
the URI grammar's own messages, for servers without CEL.
"""
from __future__ import annotations

from typing import Literal

from .model_uri import SIM_PROFILE, SPEC_URI_PATTERN
from .schema import CelRule, Quantity, SpecModel, spec_field

MODEL_SOURCES = ("builtin", "image", "pvc", "sim")
# How a model image reaches the server: auto picks image-volume where the cluster has them.
OCI_MOUNTS = ("auto", "image-volume", "modelcar")
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"
# A quantity without a sign (a size).
SIZE_PATTERN = (r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


class SecretRef(SpecModel):
    """A Secret in the service's namespace whose keys become the download step's environment:
    ``HF_TOKEN`` for the Hub, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SESSION_TOKEN``) for S3."""

    name: str = spec_field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN, rule="a Secret name")


class S3Spec(SpecModel):
    """``spec.model.s3``: an S3-compatible endpoint URL (None: AWS) and its region."""

    endpoint: str | None = spec_field(None, pattern=r"^https?://\S+$", max_length=1024, rule="an http(s) URL")
    region: str | None = spec_field(None, min_length=1, max_length=64)


class ModelCacheSpec(SpecModel):
    """``spec.model.cache``: where downloaded weights are kept. ``claim_name``: a
    ReadWriteMany PersistentVolumeClaim that every pod of the service (and others) shares; the
    first pod downloads a revision, the others wait for it and reuse it. ``host_path``: a
    directory on each node (one download per node; needs a namespace whose Pod Security level
    admits hostPath volumes). Neither: an emptyDir per pod (one download per pod start).
    ``max_size``: a quantity; older revisions are evicted above it (None: never)."""

    cel_rules = (CelRule("!has(self.claimName) || !has(self.hostPath)",
                         "cache takes claimName or hostPath, not both"),)

    claim_name: str | None = spec_field(None, min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN,
                                        rule="a PersistentVolumeClaim name")
    host_path: str | None = spec_field(None, pattern="^/", max_length=1024, rule="absolute")
    # Its range is the operator's (a quantity ≥ 0), with the quantity parser's message.
    max_size: Quantity | None = spec_field(None, schema={"minimum": 0, "pattern": SIZE_PATTERN})


class OCISpec(SpecModel):
    """``spec.model.oci``: how a model image is mounted (:data:`OCI_MOUNTS`)."""

    mount: Literal[OCI_MOUNTS] = spec_field("auto")  # type: ignore[valid-type]


class ModelSpec(SpecModel):
    """Which weights the pods load (see the module docstring). ``source``: builtin | image
    (``path`` inside the image, absolute) | pvc (``path`` relative to the root of
    PersistentVolumeClaim ``claim_name``) | sim (no weights: ``profile``, e.g.
    ``tiny,time_scale=4``, becomes ``--model sim:PROFILE``); ``uri`` instead of all of them.

    The rules read ``source`` only where ``has()`` says it is there: the API server checks them
    against this object's default ``{}`` as written (nested defaults not applied)."""

    cel_rules = (
        CelRule("!has(self.uri) || ((!has(self.source) || self.source == 'builtin') && !has(self.path) "
                "&& !has(self.claimName) && !has(self.profile))",
                "uri names the model on its own: remove source, path, claimName and profile (source: "
                "builtin, which older servers defaulted, may stay)"),
        CelRule("has(self.uri) || (has(self.source) && self.source != 'builtin') || (!has(self.path) && "
                "!has(self.claimName))",
                "source builtin takes no path or claimName; use spec.model.uri, or source image or pvc, "
                "to load other weights"),
        CelRule("!has(self.source) || self.source != 'sim' || (!has(self.path) && !has(self.claimName))",
                "source sim takes no path or claimName: it loads no weights, its profile says what to "
                "simulate"),
        CelRule("!has(self.source) || self.source in ['builtin', 'sim'] || has(self.path)",
                "path is required with source image or pvc"),
        CelRule("!has(self.source) || self.source != 'image' || !has(self.path) || self.path.startsWith('/')",
                "path must be absolute with source image"),
        CelRule("has(self.uri) || (has(self.source) && self.source == 'pvc') == has(self.claimName)",
                "claimName is required with source pvc and only allowed with it"),
        CelRule("!has(self.source) || self.source != 'pvc' || !has(self.path) || !self.path.startsWith('/')",
                "path must be relative to the volume's root with source pvc"),
        CelRule("has(self.uri) || (has(self.source) && self.source == 'sim') == has(self.profile)",
                "profile is required with source sim and only allowed with it"),
        CelRule("(has(self.uri) && (self.uri.startsWith('s3://') || (!self.uri.startsWith('pvc://') && "
                "!self.uri.startsWith('oci://') && self.uri.contains('/')))) || (!has(self.secretRef) && "
                "!has(self.cache))",
                "secretRef and cache configure the download step, which only an hf:// or s3:// uri has"),
        CelRule("!has(self.uri) || !self.uri.matches('^pvc://.*/[.][.](/.*)?$')",
                "a pvc:// uri's path is relative to the claim's root, without '..'"),
        CelRule("(has(self.uri) && self.uri.startsWith('oci://')) || !has(self.oci)",
                "oci is only allowed with an oci:// uri"),
        CelRule("(has(self.uri) && self.uri.startsWith('s3://')) || !has(self.s3)",
                "s3 is only allowed with an s3:// uri"),
    )

    source: Literal[MODEL_SOURCES] = spec_field(  # type: ignore[valid-type]
        "builtin", crd_default=False,
        description="builtin (when neither source nor uri is set): the model shipped in the image's "
                    "Python environment (SmolLM2-135M-Instruct); image: a path inside the image; pvc: "
                    "a path on a PersistentVolumeClaim, mounted read-only; sim: no weights, the real "
                    "server with a cost model of a GPU in place of the forward pass (slipstream serve "
                    "--model sim:PROFILE), for demos and tests.")
    path: str | None = spec_field(
        None, min_length=1, max_length=1024,
        description="A GGUF file or a safetensors directory: absolute inside the image (source "
                    "image), relative to the volume's root (source pvc).")
    claim_name: str | None = spec_field(
        None, min_length=1, max_length=253,
        description="The PersistentVolumeClaim holding the weights (source pvc).")
    # The profile's and the uri's patterns are checked by the operator with the grammar's messages.
    profile: str | None = spec_field(
        None, min_length=1, max_length=253, schema={"pattern": SIM_PROFILE.pattern},
        description="With source sim: the simulated model and GPU, as slipstream serve --model "
                    "sim:PROFILE takes it: tiny, llama3-8b-h100, llama3-8b-h200 or llama3-8b-l4, "
                    "optionally followed by ,time_scale=S (wall seconds per modelled second) "
                    ",output_len=N or A-B ,seed=N ,load_seconds=S (the pod's simulated model "
                    "load, so it turns Ready S seconds later); e.g. "
                    "'tiny,time_scale=4,output_len=20-200'.")
    served_model_name: str | None = spec_field(
        None, min_length=1, max_length=256,
        description="The model name clients send in requests (default metadata.name).")
    uri: str | None = spec_field(
        None, min_length=1, max_length=1024, schema={"pattern": SPEC_URI_PATTERN},
        description="The model, named on its own (no source, path, claimName or profile beside it): "
                    "hf://ORG/NAME[@REVISION][:FILE] (or ORG/NAME) from the Hugging Face Hub, "
                    "s3://BUCKET/PREFIX from S3 or an S3-compatible store (downloaded once per "
                    "revision into spec.model.cache by an init container), "
                    "oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST] a model image with its files under "
                    "/models (see oci.mount), pvc://CLAIM/PATH on a PersistentVolumeClaim (mounted "
                    "read-only), builtin, or sim:PROFILE.")
    secret_ref: SecretRef | None = spec_field(
        None,
        description="A Secret in this namespace whose keys become the download step's environment: "
                    "HF_TOKEN for the Hub; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and "
                    "AWS_SESSION_TOKEN) for S3.")
    s3: S3Spec | None = spec_field(
        None, description="With an s3:// uri: the endpoint of an S3-compatible store (default AWS) and "
                          "its region.")
    cache: ModelCacheSpec | None = spec_field(
        None,
        description="Where downloaded weights are kept: claimName, a ReadWriteMany "
                    "PersistentVolumeClaim shared by every pod (the first downloads a revision, the "
                    "others wait and reuse it); hostPath, a directory on each node, writable by uid "
                    "10001; neither, an emptyDir per pod. maxSize: the least recently fetched other "
                    "revisions are evicted above it (keep it above the models in use).")
    oci: OCISpec | None = spec_field(
        None,
        description="With an oci:// uri: mount auto (default) uses an image volume where the API "
                    "server admits one (the operator asks with a dry run: the ImageVolume feature "
                    "gate, on by default from Kubernetes 1.35; by version when it cannot ask) and a "
                    "modelcar sidecar (the image's files reached through a shared process namespace, "
                    "KServe's pattern) elsewhere; image-volume or modelcar forces one.")
