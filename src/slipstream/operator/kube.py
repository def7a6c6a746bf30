"""A small asynchronous Kubernetes REST client: dicts in, dicts out.

The operator needs six verbs on a handful of resources; this is them over aiohttp (which kopf runs on
too), with the credentials kopf itself would use (in-cluster service account, else kubeconfig,
loaded by ``kopf.login_via_client``). API errors come back as :class:`ApiError` with the HTTP
status, so callers tell retryable (409, 429, 5xx) from permanent (400, 403, 422) mistakes.
Every write carries ``fieldManager=slipstream-operator`` (:data:`FIELD_MANAGER`), and waits
for the client's ``fence`` (lease.py: only the replica holding the operator's Lease writes).
"""
from __future__ import annotations

import json
import logging
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

import aiohttp
import kopf

from slipstream.api_types.parallelism import LWS_GROUP, LWS_PLURAL, LWS_VERSION

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
# Every write names this manager, so ``metadata.managedFields`` tells the operator's fields from
# another writer's (the autoscaler's check for a foreign scaler reads it).
FIELD_MANAGER = "slipstream-operator"
_WRITES = ("POST", "PUT", "PATCH")
_FENCED = _WRITES + ("DELETE",)


class ApiError(Exception):
    """A non-2xx answer: ``status`` (HTTP code), ``reason`` (the Status object's reason),
    ``message``."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def retryable(self) -> bool:
        """True for conflicts, throttling, timeouts and server errors: trying later can help."""
        return self.status in (408, 409, 429) or self.status >= 500


@dataclass(frozen=True, slots=True)
class Resource:
    """A resource type: ``group`` ('' for the core group), ``version``, ``plural``."""

    group: str
    version: str
    plural: str

    def path(self, namespace: str | None, name: str | None = None,
             subresource: str | None = None) -> str:
        """The URL path; ``namespace`` None for a cluster-scoped resource."""
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        if namespace is not None:
            base += f"/namespaces/{namespace}"
        path = f"{base}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


DEPLOYMENTS = Resource("apps", "v1", "deployments")
DISRUPTION_BUDGETS = Resource("policy", "v1", "poddisruptionbudgets")
EVENTS = Resource("", "v1", "events")
PODS = Resource("", "v1", "pods")
SERVICES = Resource("", "v1", "services")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts")
ROLES = Resource("rbac.authorization.k8s.io", "v1", "roles")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings")
# kubernetes-sigs/lws: served only where its CRD and controller are installed.
LEADER_WORKER_SETS = Resource(LWS_GROUP, LWS_VERSION, LWS_PLURAL)
INFERENCESERVICES = Resource("slipstream.dev", "v1alpha1", "inferenceservices")
CLUSTER_PEERINGS = Resource("kopf.dev", "v1", "clusterkopfpeerings")
# Other scalers of a workload (foreign.py); ScaledObjects are served only where KEDA is installed.
HORIZONTAL_POD_AUTOSCALERS = Resource("autoscaling", "v2", "horizontalpodautoscalers")
SCALED_OBJECTS = Resource("keda.sh", "v1alpha1", "scaledobjects")
LEASES = Resource("coordination.k8s.io", "v1", "leases")
PEERINGS = Resource("kopf.dev", "v1", "kopfpeerings")


class Kube:
    """Requests against one API server. Use :meth:`from_environment` in the operator; tests
    give ``server`` (``http://127.0.0.1:PORT``) directly."""

    def __init__(self, server: str, *, token: str | None = None, scheme: str | None = None,
                 ssl_context: ssl.SSLContext | bool = True, timeout: float = 30.0,
                 relogin: Callable[[], "Kube"] | None = None):
        self.server = server.rstrip("/")
        self._headers = {"Accept": JSON, "User-Agent": f"{FIELD_MANAGER}/python"}
        if token:
            self._headers["Authorization"] = f"{scheme or 'Bearer'} {token}"
        self._ssl = ssl_context
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._relogin = relogin
        self._version: tuple[int, int] | None = None
        self._image_volumes: bool | None = None
        # Awaited before every write; raises (an ApiError) to refuse it. None: no fence.
        self.fence: Callable[[], Awaitable[None]] | None = None

    def identify(self, identity: str) -> None:
        """Name this process in the User-Agent (``slipstream-operator/IDENTITY``), so the API
        server's audit log tells operator replicas apart. Call before the first request."""
        self._headers["User-Agent"] = f"{FIELD_MANAGER}/{identity}"

    @classmethod
    def from_environment(cls) -> "Kube":
        """Credentials as kopf finds them: in-cluster, else ``$KUBECONFIG``/~/.kube/config.
        Raises kopf.LoginError when neither exists. On a 401 it logs in again once (service
        account tokens rotate)."""
        info = kopf.login_via_client(logger=logging.getLogger(__name__),
                                     settings=kopf.OperatorSettings())
        if info is None:
            raise kopf.LoginError("the kubernetes client library is not installed")
        context: ssl.SSLContext | bool = True
        if info.server.startswith("https"):
            context = ssl.create_default_context(cafile=info.ca_path or None)
            if info.insecure:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if info.certificate_path and info.private_key_path:
                context.load_cert_chain(info.certificate_path, info.private_key_path)
        return cls(info.server, token=info.token, scheme=info.scheme, ssl_context=context,
                   relogin=cls.from_environment)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = JSON) -> dict[str, Any]:
        """One call; returns the decoded JSON body. Raises ApiError on a non-2xx answer, or
        the fence's refusal of a write."""
        if self.fence is not None and method in _FENCED:
            await self.fence()
        try:
            return await self._request(method, path, body, content_type)
        except ApiError as exc:
            if exc.status != 401 or self._relogin is None:
                raise
            fresh = self._relogin()
            self._headers = {**fresh._headers, "User-Agent": self._headers["User-Agent"]}
            self._ssl = fresh._ssl
            await self.close()
            return await self._request(method, path, body, content_type)

    async def _request(self, method: str, path: str, body: Any, content_type: str,
                       ) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        headers = {"Content-Type": content_type} if body is not None else {}
        params = {"fieldManager": FIELD_MANAGER} if method in _WRITES else None
        try:
            async with self._session.request(method, self.server + path, json=body,
                                             params=params, headers=headers,
                                             ssl=self._ssl) as response:
                text = await response.text()
                try:
                    data = json.loads(text) if text else {}
                except ValueError:
                    # The API server's mux answers plain text ("404 page not found") for a
                    # group/version it does not serve, such as a CRD that is not installed.
                    if response.status < 300:
                        raise ApiError(502, "BadGateway", f"{method} {path}: not JSON: {text[:200]!r}")
                    data = {"message": text.strip()}
                if response.status >= 300:
                    data = data if isinstance(data, Mapping) else {}
                    raise ApiError(response.status, data.get("reason") or response.reason or "",
                                   data.get("message") or "")
                return data or {}
        except aiohttp.ClientError as exc:
            raise ApiError(503, "Unavailable", f"{method} {path}: {exc}") from exc

    async def server_version(self) -> tuple[int, int] | None:
        """(major, minor) of the API server from ``/version``, read once; None when it does not
        say (an emulator) or the call fails (asked again next time)."""
        if self._version is None:
            try:
                info = await self.request("GET", "/version")
                minor = str(info.get("minor", "")).rstrip("+")
                self._version = (int(info["major"]), int(minor))
            except (ApiError, KeyError, ValueError):
                return None
        return self._version

    async def image_volumes_admitted(self, namespace: str) -> bool | None:
        """Whether the API server keeps a pod's ``image`` volume, i.e. its ImageVolume feature
        gate is on (beta and off by default in 1.33-1.34, on from 1.35, locked on from 1.36).
        Asked once per process by a server-side dry run (``dryRun=All``: validated and admitted,
        never stored) of a Deployment in ``namespace`` that has one: a server with the gate off
        drops the field and then refuses the volume as having no type (422). None when the dry
        run says neither (refused for another reason, unreachable): callers go by the version."""
        if self._image_volumes is not None:
            return self._image_volumes
        labels = {"app.kubernetes.io/managed-by": FIELD_MANAGER}
        probe = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"generateName": "slipstream-image-volume-probe-", "namespace": namespace,
                         "labels": labels},
            "spec": {"selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "probe", "image": "registry.invalid/probe:1",
                                         "volumeMounts": [{"name": "model", "mountPath": "/model"}]}],
                         "volumes": [{"name": "model", "image": {"reference": "registry.invalid/model:1"}}]}}},
        }
        try:
            made = await self.create(DEPLOYMENTS, probe, dry_run=True)
        except ApiError as exc:
            if exc.status == 422 and "volumes[0]" in exc.message:
                self._image_volumes = False
            return self._image_volumes
        volumes = made.get("spec", {}).get("template", {}).get("spec", {}).get("volumes") or []
        self._image_volumes = any("image" in v for v in volumes)
        return self._image_volumes

    async def get(self, resource: Resource, namespace: str | None, name: str,
                  ) -> dict[str, Any] | None:
        """The object, or None when it does not exist (404)."""
        try:
            return await self.request("GET", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, resource: Resource, namespace: str | None,
                   label_selector: str | None = None) -> list[dict[str, Any]]:
        """The items of a list call (``label_selector`` like ``a=b,c=d``)."""
        query = f"?{urllib.parse.urlencode({'labelSelector': label_selector})}" \
            if label_selector else ""
        answer = await self.request("GET", resource.path(namespace) + query)
        return list(answer.get("items") or [])

    async def create(self, resource: Resource, obj: Mapping[str, Any], *, dry_run: bool = False,
                     ) -> dict[str, Any]:
        """POST; ``dry_run``: validated and admitted as a create, never stored (``dryRun=All``)."""
        path = resource.path(obj["metadata"].get("namespace"))
        return await self.request("POST", path + ("?dryRun=All" if dry_run else ""), obj)

    async def replace(self, resource: Resource, obj: Mapping[str, Any]) -> dict[str, Any]:
        """PUT; ``obj.metadata.resourceVersion`` makes it fail with 409 if the object moved."""
        meta = obj["metadata"]
        return await self.request("PUT", resource.path(meta["namespace"], meta["name"]), obj)

    async def delete(self, resource: Resource, namespace: str | None, name: str) -> bool:
        """DELETE; False when it was already gone (404)."""
        try:
            await self.request("DELETE", resource.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def merge_patch(self, resource: Resource, namespace: str, name: str,
                          patch: Mapping[str, Any], subresource: str | None = None,
                          ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386): dicts merge, lists and scalars replace, None deletes.
        A ``metadata.resourceVersion`` in ``patch`` makes it fail with 409 if the object moved."""
        return await self.request("PATCH", resource.path(namespace, name, subresource), patch,
                                  content_type=MERGE_PATCH)
