"""Pod Events as the kubelet's event recorder writes them (source component ``kubelet``).

Writes happen on one background thread, so a slow API server never stalls a pod. A repeat of
the same (object, field, type, reason, message) within 10 minutes bumps ``count`` and
``lastTimestamp`` of the existing Event, at most once per REPEAT_WRITE_S per event, as
client-go's correlator does, instead of creating another.
"""
from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("kubelet.events")
AGGREGATE_S = 600.0
REPEAT_WRITE_S = 5.0


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Seen:
    __slots__ = ("name", "namespace", "count", "last_write")

    def __init__(self, name: str, namespace: str):
        self.name, self.namespace = name, namespace
        self.count = 1
        self.last_write = time.monotonic()


class EventRecorder:
    def __init__(self, api: client.ApiClient, node: str):
        self.core = client.CoreV1Api(api)
        self.node = node
        self._queue: queue.Queue = queue.Queue()
        self._seen: dict[tuple, _Seen] = {}
        threading.Thread(target=self._run, name="events", daemon=True).start()

    def emit(self, pod: dict, type_: str, reason: str, message: str, field_path: str | None = None) -> None:
        """Records an Event about ``pod`` (``field_path``: ``spec.containers{NAME}`` and the like)."""
        self._queue.put((pod["metadata"], type_, reason, message, field_path, now_rfc3339()))

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self._write(*item)
            except Exception as err:  # noqa: BLE001 - an Event is best effort, as in the kubelet
                log.warning("event not written: %s", err)

    def _write(self, meta: dict, type_: str, reason: str, message: str, field: str | None, stamp: str) -> None:
        key = (meta["uid"], field, type_, reason, message)
        seen = self._seen.get(key)
        if seen and time.monotonic() - seen.last_write < AGGREGATE_S:
            seen.count += 1
            if time.monotonic() - seen.last_write >= REPEAT_WRITE_S:
                self._bump(seen, stamp)
            return
        involved = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"],
                    "name": meta["name"], "uid": meta["uid"]}
        if field:
            involved["fieldPath"] = field
        name = f"{meta['name']}.{time.time_ns():x}"
        body = {"metadata": {"name": name, "namespace": meta["namespace"]},
                "involvedObject": involved, "type": type_, "reason": reason, "message": message,
                "source": {"component": "kubelet", "host": self.node},
                "reportingComponent": "kubelet", "reportingInstance": self.node,
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
        except ApiException as err:
            if err.status != 403 and err.status != 404:  # namespace gone or terminating
                raise
            return
        self._seen[key] = _Seen(name, meta["namespace"])
        self._prune()

    def _bump(self, seen: _Seen, stamp: str) -> None:
        seen.last_write = time.monotonic()
        try:
            self.core.patch_namespaced_event(seen.name, seen.namespace,
                                             {"count": seen.count, "lastTimestamp": stamp},
                                             _preload_content=False)
        except ApiException as err:
            if err.status != 404:
                raise

    def _prune(self) -> None:
        if len(self._seen) > 4096:
            cutoff = time.monotonic() - AGGREGATE_S
            self._seen = {k: v for k, v in self._seen.items() if v.last_write > cutoff}
