"""The image table: which image references this kubelet can "pull", and what each one runs.

An image here is not a filesystem: it is an entrypoint, a default command, an environment and a
user, as the image's Dockerfile sets them, run on the host's filesystem. This project's images
(docker/*.Dockerfile) map to the repository's virtualenv; a busybox/python image maps to the
host's tools, for small test pods. An image on a registry on loopback (a model image, as a
modelcar sidecar runs it) is really pulled: it runs the host's tools as busybox does, and its own
top-level directories that the host lacks (``/models``) are bound read-only into its container
(``files``: the image volumes' export cache, volumes.pull_image). Any other reference fails as a
registry's "not found" does.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import volumes

HOST_PATH = "/usr/local/bin:/usr/bin:/bin"
SLIPSTREAM_UID = 10001  # docker/*.Dockerfile: USER 10001:10001


@dataclass(frozen=True, slots=True)
class Image:
    ref: str                       # normalized: registry/repository:tag
    image_id: str                  # what containerStatuses[].imageID reports
    entrypoint: list[str]          # used when the container has no `command`
    cmd: list[str]                 # used when the container has neither `command` nor `args`
    env: dict[str, str] = field(default_factory=dict)
    uid: int = 0
    gid: int = 0
    workdir: str = "/"
    home: str | None = None        # a private writable directory per pod is mounted here
    files: Path | None = None      # a pulled image's files (see container.image_dirs)


class ImagePullError(Exception):
    """The image is not in the table: the message is what containerd says for a missing tag."""


def normalize(ref: str) -> str:
    """``busybox`` → ``docker.io/library/busybox:latest``, as the container runtime names it."""
    name, digest = (ref.split("@", 1) + [""])[:2]
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = f"docker.io/library/{name}"
    elif not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}"
    if digest:
        return f"{name}@{digest}"
    if ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name


def _repository(ref: str) -> str:
    """A normalized reference without its tag or digest: ``registry/repository``."""
    return ref.rsplit(":", 1)[0] if "@" not in ref else ref.split("@", 1)[0]


def _image_id(ref: str) -> str:
    return f"{_repository(ref)}@sha256:{hashlib.sha256(ref.encode()).hexdigest()}"


def resolve(ref: str, repo: Path, state_dir: Path | None = None, policy: str = "IfNotPresent") -> Image:
    """The Image for ``ref``: from the table, or pulled (``policy`` Always, IfNotPresent or
    Never) into ``state_dir`` when it is on a registry on loopback; raises ImagePullError for a
    reference outside the table, or with the registry's message when the pull fails."""
    full = normalize(ref)
    if state_dir is not None and volumes.on_local_registry(full):
        try:
            digest, files = volumes.pull_image(full, policy, state_dir)
        except volumes.MountError as err:
            raise ImagePullError(f"rpc error: code = Unknown desc = {err}") from None
        return Image(full, f"{_repository(full)}@{digest}", [], ["sh"], {"PATH": HOST_PATH, "HOME": "/root"},
                     files=files)
    venv_path = f"{repo / '.venv' / 'bin'}:{HOST_PATH}"
    if re.fullmatch(r"ghcr\.io/slipstream-dev/slipstream(:[^@]+|@sha256:[0-9a-f]+)", full):
        cuda = "-cuda" in full.rsplit(":", 1)[-1]
        serve = ["serve", "--model", "builtin", *(["--device", "cuda"] if cuda else []),
                 "--host", "0.0.0.0", "--port", "8000"]
        return Image(full, _image_id(full), ["slipstream"], serve,
                     {"PATH": venv_path, "PYTHONUNBUFFERED": "1", "HOME": "/home/slipstream"},
                     SLIPSTREAM_UID, SLIPSTREAM_UID, "/home/slipstream", "/home/slipstream")
    if re.fullmatch(r"ghcr\.io/slipstream-dev/slipstream-operator(:[^@]+|@sha256:[0-9a-f]+)", full):
        return Image(full, _image_id(full), ["slipstream"],
                     ["operator", "run", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"],
                     {"PATH": venv_path, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
                      "HOME": "/tmp"},
                     SLIPSTREAM_UID, SLIPSTREAM_UID)
    if re.fullmatch(r"docker\.io/library/busybox:[^@]+", full):
        return Image(full, _image_id(full), [], ["sh"], {"PATH": HOST_PATH, "HOME": "/root"})
    if re.fullmatch(r"docker\.io/library/python:[^@]+", full):
        return Image(full, _image_id(full), [], ["python3"],
                     {"PATH": HOST_PATH, "HOME": "/root"})
    raise ImagePullError(
        f'rpc error: code = NotFound desc = failed to pull and unpack image "{full}": '
        f'failed to resolve reference "{full}": {full}: not found')
