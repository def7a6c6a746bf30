"""Endpoints from a Service's EndpointSlices: the gateway's view of which pods can take requests.

The EndpointSlice controller lists every pod a Service selects, with conditions: ``ready``
(passes its readiness probe; unset means ready), ``serving`` and ``terminating`` (being deleted).
The gateway sends new requests to ready, not terminating endpoints only, so a pod that is
draining finishes what it holds and gets nothing new. :func:`ready_urls` is the pure part;
:class:`EndpointSliceWatcher` lists and watches the slices with the official Kubernetes client
(in a thread: the client is synchronous) and hands every change to the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Callable, Iterable, Mapping

log = logging.getLogger("slipstream.gateway")

SERVICE_LABEL = "kubernetes.io/service-name"


def _get(obj: Any, key: str, attr: str) -> Any:
    """A field of an EndpointSlice as a dict (JSON) or as a client model object."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, attr, None)


def ready_urls(slices: Iterable[Any], *, port: int | None = None, port_name: str | None = None,
               scheme: str = "http") -> list[str]:
    """Base URLs (``http://10.244.0.7:8000``, IPv6 bracketed) of the ready, not terminating
    endpoints in ``slices`` (EndpointSlice objects as dicts or kubernetes client models), sorted,
    without duplicates.

    port: use this port; else the slice's port named ``port_name``, else its only port. A slice
    with no usable port is skipped.
    """
    urls: set[str] = set()
    for s in slices:
        ports = _get(s, "ports", "ports") or []
        chosen = port
        if chosen is None:
            named = [p for p in ports if port_name is None or _get(p, "name", "name") == port_name]
            if len(named) == 1 or (named and port_name is not None):
                chosen = _get(named[0], "port", "port")
        if chosen is None:
            continue
        for endpoint in _get(s, "endpoints", "endpoints") or []:
            conditions = _get(endpoint, "conditions", "conditions") or {}
            ready = _get(conditions, "ready", "ready")
            if ready is False or _get(conditions, "terminating", "terminating"):
                continue
            for address in _get(endpoint, "addresses", "addresses") or []:
                host = f"[{address}]" if ":" in address else address
                urls.add(f"{scheme}://{host}:{chosen}")
    return sorted(urls)


def apply_event(slices: dict[str, Any], event: Mapping[str, Any]) -> str | None:
    """Apply one watch event to ``slices`` (name → EndpointSlice); returns the resourceVersion it
    carries (None: none). A BOOKMARK carries only that: the kubernetes client leaves its object a
    dict, as it may be incomplete."""
    obj = event["object"]
    metadata = _get(obj, "metadata", "metadata") or {}
    version = _get(metadata, "resourceVersion", "resource_version")
    if event["type"] == "DELETED":
        slices.pop(_get(metadata, "name", "name"), None)
    elif event["type"] in ("ADDED", "MODIFIED"):
        slices[_get(metadata, "name", "name")] = obj
    return version


class EndpointSliceWatcher:
    """Follows the EndpointSlices of Service ``namespace/service`` and calls ``on_change(urls)``
    on the event loop whenever the set of ready URLs changes (once at start, too).

    port / port_name: as :func:`ready_urls`. api_client: a ``kubernetes.client.ApiClient``; None
    loads the in-cluster service account, else the kubeconfig. The watch is restarted from a
    fresh list after an expired resourceVersion (410) or any error, after ``retry_seconds``.
    Needs get/list/watch on ``discovery.k8s.io`` endpointslices in the namespace.
    """

    def __init__(self, namespace: str, service: str, on_change: Callable[[list[str]], None], *,
                 port: int | None = None, port_name: str | None = None, api_client: Any = None,
                 retry_seconds: float = 1.0, watch_seconds: int = 30):
        self.namespace, self.service, self.on_change = namespace, service, on_change
        self.port, self.port_name = port, port_name
        self.retry_seconds, self.watch_seconds = retry_seconds, watch_seconds
        self._api_client = api_client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last: list[str] | None = None
        self.synced = asyncio.Event()  # set after the first list was handed over

    def start(self) -> None:
        """Start watching (idempotent); call from the event loop that should get the changes."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.watch_seconds + 5)

    def _client(self):
        from kubernetes import client, config

        if self._api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api_client = client.ApiClient()
        return client.DiscoveryV1Api(self._api_client)

    def _publish(self, slices: Mapping[str, Any]) -> None:
        urls = ready_urls(slices.values(), port=self.port, port_name=self.port_name)
        if urls != self._last:
            self._last = urls
            self._loop.call_soon_threadsafe(self._deliver, urls)

    def _deliver(self, urls: list[str]) -> None:
        self.on_change(urls)
        self.synced.set()

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        selector = f"{SERVICE_LABEL}={self.service}"
        while not self._stop.is_set():
            try:
                api = self._client()
                listed = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: s for s in listed.items}
                self._publish(slices)
                version = listed.metadata.resource_version
                while not self._stop.is_set():
                    stream = watch.Watch().stream(
                        api.list_namespaced_endpoint_slice, self.namespace, label_selector=selector,
                        resource_version=version, timeout_seconds=self.watch_seconds,
                        allow_watch_bookmarks=True)
                    for event in stream:
                        version = apply_event(slices, event) or version
                        if event["type"] != "BOOKMARK":
                            self._publish(slices)
                        if self._stop.is_set():
                            break
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: the version expired; relist at once
                    log.warning("EndpointSlice watch of %s/%s failed: %s %s", self.namespace, self.service,
                                exc.status, exc.reason)
                    self._stop.wait(self.retry_seconds)
            except Exception as exc:  # the API server restarting, a network error: relist
                log.warning("EndpointSlice watch of %s/%s failed: %s", self.namespace, self.service, exc)
                self._stop.wait(self.retry_seconds)
