"""Reads of the API objects a pod refers to (ConfigMaps, Secrets, claims, tokens), as plain dicts.

Raw JSON (``_preload_content=False``) keeps the API's field names, so the rest of the kubelet
reads pods and their references exactly as ``kubectl get -o json`` shows them.
"""
from __future__ import annotations

import base64
import json

from kubernetes import client
from kubernetes.client.rest import ApiException


def raw(call, *args, **kwargs) -> dict | None:
    """``call(*args)`` as a dict; None when the object does not exist (404)."""
    try:
        return json.loads(call(*args, _preload_content=False, **kwargs).data)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


class Objects:
    """The kubelet's reader of a pod's references (implements env.Lookup)."""

    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)

    def configmap_files(self, namespace: str, name: str) -> dict[str, bytes] | None:
        cm = raw(self.core.read_namespaced_config_map, name, namespace)
        if cm is None:
            return None
        files = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        files.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        return files

    def secret_files(self, namespace: str, name: str) -> dict[str, bytes] | None:
        secret = raw(self.core.read_namespaced_secret, name, namespace)
        if secret is None:
            return None
        files = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        files.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
        return files

    def configmap(self, namespace: str, name: str) -> dict[str, str] | None:
        files = self.configmap_files(namespace, name)
        return None if files is None else {k: v.decode(errors="replace") for k, v in files.items()}

    def secret(self, namespace: str, name: str) -> dict[str, str] | None:
        files = self.secret_files(namespace, name)
        return None if files is None else {k: v.decode(errors="replace") for k, v in files.items()}

    def service_account(self, namespace: str, name: str) -> dict | None:
        return raw(self.core.read_namespaced_service_account, name, namespace)

    def claim(self, namespace: str, name: str) -> dict | None:
        return raw(self.core.read_namespaced_persistent_volume_claim, name, namespace)

    def volume(self, name: str) -> dict | None:
        return raw(self.core.read_persistent_volume, name)

    def token(self, pod: dict, audience: str | None, expiration_seconds: int) -> str:
        """A ServiceAccount token for the pod's ServiceAccount, bound to the pod (TokenRequest)."""
        meta = pod["metadata"]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
            "audiences": [audience] if audience else [],
            "expirationSeconds": expiration_seconds,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
        sa = pod["spec"].get("serviceAccountName") or "default"
        reply = raw(self.core.create_namespaced_service_account_token, sa, meta["namespace"], body)
        if reply is None:
            raise LookupError(f'serviceaccount "{sa}" not found')
        return reply["status"]["token"]
