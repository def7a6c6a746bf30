"""A container's environment and command line, as the kubelet builds them from the pod spec.

Pure functions of the pod (a dict as the API returns it), the image and a ``Lookup`` for the
ConfigMaps and Secrets that ``valueFrom``/``envFrom`` name. A missing non-optional source raises
ConfigError with the kubelet's message; the container then waits with CreateContainerConfigError.
"""
from __future__ import annotations

import math
import re
from typing import Callable, Protocol

from kubernetes.utils import parse_quantity

NODE_ALLOCATABLE = {"cpu": "16", "memory": "64Gi", "ephemeral-storage": "100Gi"}


class ConfigError(Exception):
    """The container's configuration cannot be built (CreateContainerConfigError)."""


class Image(Protocol):
    """What a container inherits from its image (``images.Image``): the entrypoint, the default
    command and the environment."""

    @property
    def entrypoint(self) -> list[str]: ...

    @property
    def cmd(self) -> list[str]: ...

    @property
    def env(self) -> dict[str, str]: ...


class Lookup(Protocol):
    def configmap(self, namespace: str, name: str) -> dict[str, str] | None: ...
    def secret(self, namespace: str, name: str) -> dict[str, str] | None: ...


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, undefined references are
    left as written, ``$$`` escapes a ``$``."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def field_value(pod: dict, path: str) -> str:
    """A downward-API ``fieldRef.fieldPath`` of ``pod``, e.g. ``metadata.labels['app']``."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m[1]) or {}).get(m[2], "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldPath: {path}")
    return simple[path] or ""


def resource_value(pod: dict, ref: dict, default_container: str | None = None) -> str:
    """A ``resourceFieldRef`` (``limits.cpu``, ``requests.memory``, …): limits fall back to the
    node's allocatable, as the kubelet does; the value is rounded up to a multiple of ``divisor``."""
    name = ref.get("containerName") or default_container
    containers = pod["spec"].get("containers", []) + pod["spec"].get("initContainers", [])
    container = next((c for c in containers if c["name"] == name), {})
    kind, resource = ref["resource"].split(".", 1)
    resources = container.get("resources") or {}
    value = (resources.get(kind) or {}).get(resource)
    if value is None and kind == "requests":
        value = (resources.get("limits") or {}).get(resource)
    if value is None:
        value = NODE_ALLOCATABLE.get(resource, "0") if kind == "limits" else "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


def _key_ref(ref: dict, kind: str, namespace: str, get: Callable[[str, str], dict | None]) -> str | None:
    data = get(namespace, ref["name"])
    optional = bool(ref.get("optional"))
    if data is None:
        if optional:
            return None
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found')
    if ref["key"] not in data:
        if optional:
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
    return data[ref["key"]]


def container_env(pod: dict, container: dict, image: Image, service_env: dict[str, str],
                  lookup: Lookup) -> dict[str, str]:
    """The process environment: the image's, then the service variables, ``HOSTNAME``, then
    ``envFrom`` and ``env`` in order (later entries win; ``$(VAR)`` sees the earlier ones)."""
    namespace = pod["metadata"]["namespace"]
    env = dict(image.env)
    env.update(service_env)
    env["HOSTNAME"] = pod["spec"].get("hostname") or pod["metadata"]["name"]
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref, data = source["configMapRef"], lookup.configmap(namespace, source["configMapRef"]["name"])
            kind = "configmap"
        else:
            ref, data = source["secretRef"], lookup.secret(namespace, source["secretRef"]["name"])
            kind = "secret"
        if data is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f'{kind} "{ref["name"]}" not found')
        env.update({prefix + k: v for k, v in data.items()})
    defined = dict(env)
    for var in container.get("env") or []:
        value = _env_value(pod, container, var, lookup, defined)
        if value is not None:
            env[var["name"]] = value
            defined[var["name"]] = value
    return env


def _env_value(pod: dict, container: dict, var: dict, lookup: Lookup, defined: dict[str, str]) -> str | None:
    if "valueFrom" not in var:
        return expand(var.get("value", ""), defined)
    source = var["valueFrom"]
    namespace = pod["metadata"]["namespace"]
    if "fieldRef" in source:
        return field_value(pod, source["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in source:
        return resource_value(pod, source["resourceFieldRef"], container["name"])
    if "configMapKeyRef" in source:
        return _key_ref(source["configMapKeyRef"], "ConfigMap", namespace, lookup.configmap)
    if "secretKeyRef" in source:
        return _key_ref(source["secretKeyRef"], "Secret", namespace, lookup.secret)
    raise ConfigError(f"unsupported valueFrom in env var {var['name']}")


def command_line(container: dict, image: Image, env: dict[str, str]) -> list[str]:
    """``command`` replaces the entrypoint and ``args`` the image's CMD, as Docker and the
    kubelet combine them; ``$(VAR)`` is expanded in both."""
    command = container.get("command")
    args = container.get("args")
    if command is None:
        argv = image.entrypoint + (args if args is not None else image.cmd)
    else:
        argv = list(command) + list(args or [])
    argv = [expand(a, env) for a in argv]
    if not argv:
        raise ConfigError("no command specified")
    return argv
