"""A pod's volumes as host paths, which the launcher bind-mounts into each container.

emptyDir, configMap, secret, downwardAPI and projected volumes live under the pod's directory
(``<pod dir>/.volumes/<name>``; a ``medium: Memory`` emptyDir is a tmpfs mounted there); a
PersistentVolumeClaim is its PersistentVolume's hostPath/local path when it has one, else a
directory per claim under ``<state dir>/pvc/``; hostPath is the host path itself; an image volume
is the image's files, flattened by go-containerregistry's ``crane export`` once per digest under
``<state dir>/image-volumes/`` (registries on loopback speak plain HTTP; images.py runs container
images from the same cache).
A volume that cannot be set up raises MountError (the kubelet's FailedMount event text).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

from .env import ConfigError, field_value, resource_value
from .objects import Objects

TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_FALLBACK = ".kube-api-access"  # the token volume this kubelet adds when admission did not


class MountError(Exception):
    """A volume could not be set up; the pod waits in ContainerCreating and retries."""


@dataclass(frozen=True, slots=True)
class HostVolume:
    path: Path
    read_only: bool = False


def prepare(pod: dict, pod_dir: Path, state_dir: Path, objects: Objects) -> dict[str, HostVolume]:
    """Materializes every volume of ``pod``; returns name → HostVolume."""
    out = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        try:
            out[name] = _prepare_one(pod, volume, pod_dir / ".volumes" / name, state_dir, objects)
        except (MountError, ConfigError, LookupError) as err:
            raise MountError(f'MountVolume.SetUp failed for volume "{name}" : {err}') from err
    return out


def _prepare_one(pod: dict, volume: dict, target: Path, state_dir: Path, objects: Objects) -> HostVolume:
    ns = pod["metadata"]["namespace"]
    fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    if "emptyDir" in volume:
        return _empty_dir(volume["emptyDir"] or {}, target)
    if "configMap" in volume:
        src = volume["configMap"]
        files = _select(objects.configmap_files(ns, src["name"]), src, "configmap")
        _write_files(target, files, src.get("defaultMode", 0o644), fs_group)
        return HostVolume(target, read_only=True)
    if "secret" in volume:
        src = {**volume["secret"], "name": volume["secret"]["secretName"]}
        files = _select(objects.secret_files(ns, src["name"]), src, "secret")
        _write_files(target, files, src.get("defaultMode", 0o644), fs_group)
        return HostVolume(target, read_only=True)
    if "downwardAPI" in volume:
        src = volume["downwardAPI"]
        _write_files(target, _downward_files(pod, src.get("items") or []), src.get("defaultMode", 0o644), fs_group)
        return HostVolume(target, read_only=True)
    if "projected" in volume:
        src = volume["projected"]
        _write_files(target, _projected_files(pod, src.get("sources") or [], objects),
                     src.get("defaultMode", 0o644), fs_group)
        return HostVolume(target, read_only=True)
    if "persistentVolumeClaim" in volume:
        src = volume["persistentVolumeClaim"]
        return HostVolume(_claim_path(ns, src["claimName"], state_dir, objects), bool(src.get("readOnly")))
    if "hostPath" in volume:
        return HostVolume(_host_path(volume["hostPath"]))
    if "image" in volume:
        return HostVolume(_image_volume(volume["image"], state_dir), read_only=True)
    kind = next((k for k in volume if k != "name"), "?")
    raise MountError(f"volume type {kind} is not supported by the process kubelet")


def _empty_dir(src: dict, target: Path) -> HostVolume:
    target.mkdir(parents=True, exist_ok=True)
    if src.get("medium") == "Memory" and not os.path.ismount(target):
        size = f",size={src['sizeLimit']}" if src.get("sizeLimit") else ""
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode=1777{size}", "tmpfs", str(target)], check=True)
    target.chmod(0o777)
    return HostVolume(target)


def _select(data: dict[str, bytes] | None, src: dict, kind: str) -> dict[str, tuple[bytes, int | None]]:
    """The files of a configMap/secret source: all keys, or ``items`` (key → path, mode)."""
    if data is None:
        if src.get("optional"):
            return {}
        raise MountError(f'{kind} "{src["name"]}" not found')
    if not src.get("items"):
        return {k: (v, None) for k, v in data.items()}
    out = {}
    for item in src["items"]:
        if item["key"] not in data:
            if src.get("optional"):
                continue
            raise MountError(f"{kind} references non-existent config key: {item['key']}")
        out[item["path"]] = (data[item["key"]], item.get("mode"))
    return out


def _downward_files(pod: dict, items: list[dict]) -> dict[str, tuple[bytes, int | None]]:
    out = {}
    for item in items:
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"])
        else:
            value = resource_value(pod, item["resourceFieldRef"])
        out[item["path"]] = (value.encode(), item.get("mode"))
    return out


def _projected_files(pod: dict, sources: list[dict], objects: Objects) -> dict[str, tuple[bytes, int | None]]:
    ns = pod["metadata"]["namespace"]
    out: dict[str, tuple[bytes, int | None]] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            src = source["serviceAccountToken"]
            token = objects.token(pod, src.get("audience"), src.get("expirationSeconds", 3600))
            out[src["path"]] = (token.encode(), None)
        elif "configMap" in source:
            out.update(_select(objects.configmap_files(ns, source["configMap"]["name"]), source["configMap"], "configmap"))
        elif "secret" in source:
            out.update(_select(objects.secret_files(ns, source["secret"]["name"]), source["secret"], "secret"))
        elif "downwardAPI" in source:
            out.update(_downward_files(pod, source["downwardAPI"].get("items") or []))
        else:
            raise MountError(f"projected source {next(iter(source))} is not supported by the process kubelet")
    return out


def _write_files(target: Path, files: dict[str, tuple[bytes, int | None]], default_mode: int,
                 fs_group: int | None = None) -> None:
    """Writes ``files`` (relative path → content, mode) under a fresh ``target``; with an
    ``fsGroup`` the files belong to that group, which may read them (the kubelet's ownership)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    target.chmod(0o755)
    for rel, (content, mode) in files.items():
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        mode = mode if mode is not None else default_mode
        if fs_group is not None:
            os.chown(path, 0, fs_group)
            mode |= 0o040
        path.chmod(mode)


def _claim_path(namespace: str, claim_name: str, state_dir: Path, objects: Objects) -> Path:
    claim = objects.claim(namespace, claim_name)
    if claim is None:
        raise MountError(f'persistentvolumeclaim "{claim_name}" not found')
    pv_name = (claim.get("spec") or {}).get("volumeName")
    pv = objects.volume(pv_name) if pv_name else None
    source = (pv or {}).get("spec") or {}
    for kind in ("hostPath", "local"):
        if kind in source:
            path = Path(source[kind]["path"])
            path.mkdir(parents=True, exist_ok=True)
            return path
    path = state_dir / "pvc" / f"{namespace}_{claim_name}"
    if not path.exists():
        path.mkdir(parents=True)
        path.chmod(0o777)
    return path


CRANE = Path(__file__).resolve().parents[3] / "build" / "cluster" / "bin" / "crane"
LOCAL_REGISTRIES = ("127.0.0.1", "localhost", "10.244.0.1")


def _crane(command: str, ref: str, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    crane = shutil.which("crane") or str(CRANE)
    try:
        return subprocess.run([crane, command, ref, *args], stdout=stdout, stderr=subprocess.PIPE,
                              check=True, timeout=600)
    except FileNotFoundError:
        raise MountError("pulling images needs crane: run `make cluster`") from None
    except subprocess.CalledProcessError as err:
        raise MountError(f'failed to pull image "{ref}": {err.stderr.decode(errors="replace").strip()}') from None


def _image_volume(src: dict, state_dir: Path) -> Path:
    """The files of image ``src["reference"]`` as a read-only directory (pullPolicy Always,
    IfNotPresent — the default — and Never as for container images)."""
    ref = src.get("reference") or ""
    if not ref:
        raise MountError("image volume without a reference")
    return pull_image(ref, src.get("pullPolicy") or "IfNotPresent", state_dir)[1]


def on_local_registry(ref: str) -> bool:
    """Whether ``ref`` names an image on a registry on loopback (or the pod network's gateway)."""
    return ref.split("/", 1)[0].split(":", 1)[0] in LOCAL_REGISTRIES


def pull_image(ref: str, policy: str, state_dir: Path) -> tuple[str, Path]:
    """(digest, directory of the image's files) for ``ref`` under pull ``policy`` (Always,
    IfNotPresent, Never): exported with crane once per digest under ``<state dir>/image-volumes/``,
    shared by image volumes and container images. Raises MountError with the registry's message."""
    if not on_local_registry(ref):
        # Tests reach nothing off this machine: only the tests' own registries are pulled from.
        raise MountError(f'failed to pull image "{ref}": not found (the process kubelet pulls '
                         f'images from registries on {", ".join(LOCAL_REGISTRIES)} only)')
    root = state_dir / "image-volumes"
    pulled = root / "by-reference" / hashlib.sha256(ref.encode()).hexdigest()
    if policy != "Always" and pulled.is_symlink() and pulled.exists():
        target = pulled.resolve()
        return target.name.replace("-", ":", 1), target
    if policy == "Never":
        raise MountError(f'image "{ref}" is not present with pull policy of Never')
    digest = _crane("digest", ref).stdout.decode().strip()
    target = root / digest.replace(":", "-")
    if not target.is_dir():
        tmp = root / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tar = tmp.with_suffix(".tar")
        with open(tar, "wb") as out:
            _crane("export", ref, "-", stdout=out)
        subprocess.run(["tar", "-x", "-f", str(tar), "-C", str(tmp), "--no-same-owner"], check=True)
        tar.unlink()
        os.chmod(tmp, 0o755)
        try:
            tmp.rename(target)
        except OSError:  # another pod's worker exported the same digest meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    pulled.parent.mkdir(parents=True, exist_ok=True)
    link = pulled.with_name(f".{pulled.name}.{threading.get_ident()}")
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    link.replace(pulled)
    return digest, target


def _host_path(src: dict) -> Path:
    path, kind = Path(src["path"]), src.get("type") or ""
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    elif kind in ("Directory", "File", "Socket") and not path.exists():
        raise MountError(f"hostPath type check failed: {path} does not exist")
    return path


def token_fallback(pod: dict, pod_dir: Path, objects: Objects, ca_pem: bytes) -> dict[str, HostVolume]:
    """The ServiceAccount token directory (token, ca.crt, namespace) for a pod that wants one
    but has no volume mounted there (the ServiceAccount admission plugin adds one): {} or
    {TOKEN_FALLBACK: volume}, which every container then mounts at TOKEN_DIR."""
    spec = pod["spec"]
    mounted = any(m["mountPath"].rstrip("/") == TOKEN_DIR
                  for c in spec["containers"] + (spec.get("initContainers") or [])
                  for m in c.get("volumeMounts") or [])
    automount = spec.get("automountServiceAccountToken")
    if automount is None:
        sa = objects.service_account(pod["metadata"]["namespace"], spec.get("serviceAccountName") or "default")
        automount = (sa or {}).get("automountServiceAccountToken", True)
    if mounted or not automount:
        return {}
    target = pod_dir / ".volumes" / TOKEN_FALLBACK
    try:
        token = objects.token(pod, None, 3600)
    except LookupError as err:
        raise MountError(f'MountVolume.SetUp failed for volume "{TOKEN_FALLBACK}" : {err}') from err
    _write_files(target, {"token": (token.encode(), None), "ca.crt": (ca_pem, None),
                          "namespace": (pod["metadata"]["namespace"].encode(), None)}, 0o644)
    return {TOKEN_FALLBACK: HostVolume(target, read_only=True)}


def unmount_memory(pod_dir: Path) -> None:
    """Unmounts the pod's tmpfs emptyDirs (before its directory is removed)."""
    volumes = pod_dir / ".volumes"
    if volumes.is_dir():
        for entry in volumes.iterdir():
            if os.path.ismount(entry):
                subprocess.run(["umount", "-l", str(entry)], check=False)
