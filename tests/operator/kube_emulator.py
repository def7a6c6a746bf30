"""kmock's KubernetesEmulator made strict enough for a real kopf operator.

As shipped, kmock's emulator stores objects as given: no ``resourceVersion``/``uid``/
``generation``, a failed JSON-patch ``test`` answers 500 (kopf expects 422 and so cannot add its
finalizer), PUT is not served, status is not a subresource, and no defaults are applied. This
subclass takes over the writes (POST, PUT, PATCH, DELETE) and does what the API server does:

- stamps ``uid``, ``creationTimestamp``, ``resourceVersion`` (bumped on each real change) and
  ``generation`` (bumped when anything but metadata and status changes);
- answers 409 to a create of an existing name and to a stale ``resourceVersion`` (PUT, merge
  patch), 422 to a failed JSON-patch test or invalid body, 404 to a missing object, and the
  mux's plain-text ``404 page not found`` to a resource it does not serve (no CRD);
- serves merge, JSON and (as merge) strategic-merge patches, and PUT as a replace;
- makes ``status`` a subresource where the CRD says so (the main resource ignores status
  writes, ``/status`` writes only status);
- applies the CRD's structural defaults and validates custom objects against its schema
  (jsonschema), and Deployments/Services against Kubernetes' own (kubernetes-validate);
- defaults a Deployment's ``spec.replicas`` to 1;
- records ``metadata.managedFields`` as Update operations do: whoever changes a field (by
  ``?fieldManager=``, else the User-Agent's product) takes it over from its previous manager
  (simplified: lists are single fields, not keyed by their items' names);
- deletes an object with finalizers only by setting ``deletionTimestamp``, and removes it once
  the last finalizer is gone;
- lists with the latest ``resourceVersion`` and watches from one (kmock replays every object
  to each watch and can lose a change made while a watch starts), and ends a watch after its
  ``timeoutSeconds`` as the API server does; ``stall_watches(plural)`` makes the next watch of a
  resource half-open (accepted, then silent and never ended), as after a lost connection;
- lists ``self.namespaces`` at ``/api/v1/namespaces`` (a path kmock 0.8 cannot parse).

Not covered (real-API behaviour these tests cannot see): garbage collection by owner
references, admission webhooks, CEL rules (``x-kubernetes-validations``), server-side apply and
strategic merge by list keys, label selectors on list/watch, the controllers that give a
Deployment pods and status (tests write that status by hand), Service IP allocation.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import uuid
from typing import Any, AsyncIterator

import aiohttp.web
import attrs
import jsonpatch
import jsonschema
import kmock
import kubernetes_validate
from kmock._internal import dicts as kmock_dicts

KUBERNETES_VERSION = "1.37"
_VALIDATED_KINDS = {("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets")}


def schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the ``default``s of a structural OpenAPI schema filled in (recursively,
    as the API server defaults a custom object)."""
    if isinstance(value, dict) and schema.get("type") == "object":
        value = dict(value)
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = schema_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [schema_defaults(schema["items"], item) for item in value]
    return value


# Kinds the real API server keeps no metadata.generation for (seen on v1.36: Services).
NO_GENERATION = {"services", "configmaps", "secrets", "endpoints", "events"}
_UNMANAGED_META = {"managedFields", "resourceVersion", "generation", "uid", "creationTimestamp",
                   "name", "namespace", "selfLink", "deletionTimestamp"}


def _leaves(obj: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """path → value of every leaf (a scalar, a list, an empty dict) of ``obj``."""
    if not isinstance(obj, dict) or not obj:
        return {path: obj}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in obj.items():
        if path == ("metadata",) and key in _UNMANAGED_META:
            continue
        out.update(_leaves(value, path + (key,)))
    return out


def _fields_v1(paths: set[tuple[str, ...]]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _paths(fields: dict[str, Any], path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    if not fields:
        return {path} if path else set()
    return set().union(*(_paths(sub, path + (key[2:],)) for key, sub in fields.items()))


def managed_fields(old: dict[str, Any] | None, new: dict[str, Any], manager: str,
                   subresource: str | None, api_version: str) -> list[dict[str, Any]]:
    """``new``'s managedFields after ``manager`` wrote it over ``old`` (None: a create):
    the fields it changed become its own, and no one else's."""
    before = _leaves({k: v for k, v in (old or {}).items() if k != "status"} if
                     subresource != "status" else {"status": (old or {}).get("status")})
    after = _leaves({k: v for k, v in new.items() if k != "status"} if
                    subresource != "status" else {"status": new.get("status")})
    changed = {p for p in after if before.get(p, object()) != after[p]}
    removed = set(before) - set(after)
    entries = []
    for entry in ((old or {}).get("metadata") or {}).get("managedFields") or ():
        owned = _paths(entry.get("fieldsV1") or {}) - changed - removed
        if (entry["manager"], entry.get("subresource")) == (manager, subresource):
            continue
        if owned:
            entries.append({**entry, "fieldsV1": _fields_v1(owned)})
    mine = next((e for e in ((old or {}).get("metadata") or {}).get("managedFields") or ()
                 if (e["manager"], e.get("subresource")) == (manager, subresource)), None)
    owned = (_paths(mine["fieldsV1"]) - removed if mine else set()) | changed
    if owned:
        entry = {"manager": manager, "operation": "Update", "apiVersion": api_version,
                 "time": _now(), "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(owned)}
        if subresource:
            entry["subresource"] = subresource
        entries.append(entry)
    return entries


def _manager(request: kmock.Request) -> str:
    agent = request.headers.get("User-Agent") or "unknown"
    return request.params.get("fieldManager") or agent.split("/")[0]


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _essence(obj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """See the module docstring. ``add_crd(crd)`` serves a CustomResourceDefinition's
    resource; ``fail_next(method, plural, status)`` makes the next matching write fail once."""

    _schemas: dict[Any, dict[str, Any]] = attrs.field(factory=dict, init=False)
    _status_subresource: set[Any] = attrs.field(factory=set, init=False)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _failures: list[tuple[str, str, int, str | None]] = attrs.field(factory=list, init=False)
    _log: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _stalls: list[str] = attrs.field(factory=list, init=False)
    watches: list[str] = attrs.field(factory=list, init=False)  # plural of each watch served
    namespaces: set[str] = attrs.field(factory=lambda: {"default"})

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()

    def add_crd(self, crd: dict[str, Any]) -> kmock.resource:
        """Serve the (first) version of ``crd`` like the API server would after applying it."""
        spec = crd["spec"]
        version = spec["versions"][0]
        res = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
        subresources = set(version.get("subresources") or {})
        self.resources[res] = kmock.ResourceInfo(
            kind=spec["names"]["kind"], singular=spec["names"].get("singular"),
            namespaced=spec["scope"] == "Namespaced", subresources=subresources,
            shortnames=spec["names"].get("shortNames", ()),
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"})
        self._schemas[res] = version["schema"]["openAPIV3Schema"]
        if "status" in subresources:
            self._status_subresource.add(res)
        return res

    def stall_watches(self, plural: str, count: int = 1) -> None:
        """The next ``count`` watches of ``plural`` are accepted and then send nothing, never
        ending (a half-open connection), until the client gives up."""
        self._stalls += [plural] * count

    def fail_next(self, method: str, plural: str, status: int, name: str | None = None) -> None:
        """The next ``method`` (POST, PUT, PATCH, DELETE) on ``plural`` — on the object ``name``
        when given — answers ``status``."""
        self._failures.append((method.upper(), plural, status, name))

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if raw.path.rstrip("/") == "/api/v1/namespaces":  # kmock 0.8 cannot parse this path
            return await self._serve_namespaces(raw)
        return await super().__call__(raw)

    async def _serve_namespaces(self, raw: aiohttp.web.BaseRequest,
                                ) -> aiohttp.web.StreamResponse:
        """The namespaces in ``self.namespaces`` (they never change during a test: a watch
        stays silent until the client leaves)."""
        if raw.query.get("watch") != "true":
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "NamespaceList",
                "metadata": {"resourceVersion": str(self._latest_version())},
                "items": [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                          for ns in sorted(self.namespaces)]})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw)
        while raw.transport is not None and not raw.transport.is_closing():
            await asyncio.sleep(0.2)
        return response

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        write = request.method in ("POST", "PUT", "PATCH", "DELETE")
        if request.resource is not None and request.resource.plural \
                and request.resource not in self.resources:
            # An API group/version the server does not serve (e.g. LeaderWorkerSets without
            # their CRD): the API server's mux answers plain text, not a Status object.
            return aiohttp.web.Response(status=404, text="404 page not found\n",
                                        content_type="text/plain")
        if request.resource is None or not write:
            return await super()._handle(request)  # reads: kmock serves the stored objects
        dry_run = request.params.get("dryRun") == "All"  # validated and answered, never stored
        for i, (method, plural, status, name) in enumerate([] if dry_run else self._failures):
            target = request.name or ((request.data or {}).get("metadata") or {}).get("name")
            if method == request.method and plural == request.resource.plural and name in (None, target):
                del self._failures[i]
                raise kmock.KubernetesError(status=status, reason="Injected",
                                            message=f"injected {status} for a test")
        async with self._lock:
            code, obj, event = self._write(request)
            if event is not None:  # published under the lock: watches never miss one
                self._log.append((int(obj["metadata"]["resourceVersion"]), request.resource,
                                  {"type": event, "object": obj}))
                await self._buses[request.resource].put({"type": event, "object": obj})
        return aiohttp.web.json_response(obj, status=code)

    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        listed = await super()._serve_list(request)
        listed["metadata"]["resourceVersion"] = str(self._latest_version())
        return listed

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """Like the API server: from ``?resourceVersion=N`` every change after N, else the
        current objects as ADDED; then live changes, until ``?timeoutSeconds`` (kmock's own
        subscribes after its snapshot, so a change in between is lost, and never ends)."""
        yield b""
        self.watches.append(request.resource.plural)
        if request.resource.plural in self._stalls:
            self._stalls.remove(request.resource.plural)
            await asyncio.sleep(3600)  # cancelled when the client goes or the server stops
        bus = self._buses[request.resource]
        since = request.params.get("resourceVersion")
        timeout = request.params.get("timeoutSeconds")
        deadline = asyncio.get_running_loop().time() + float(timeout) if timeout else None
        async with self._lock:
            marker = await bus.mark()
            if since and since != "0":
                replay = [event for rv, res, event in self._log
                          if res == request.resource and rv > int(since)]
            else:
                replay = [{"type": "ADDED", "object": obj.raw}
                          for (res, _, _), obj in self.objects.items()
                          if res == request.resource and not obj.deleted]
        try:
            for event in replay:
                if self._watched(request, event):
                    yield event
            stream = aiter(bus.stream(since=marker))
            while True:
                left = None if deadline is None else deadline - asyncio.get_running_loop().time()
                if left is not None and left <= 0:
                    return
                try:
                    event = await asyncio.wait_for(anext(stream), left)
                except (TimeoutError, StopAsyncIteration):
                    return
                if self._watched(request, event):
                    yield event
        finally:
            await bus.unmark(marker)

    @staticmethod
    def _watched(request: kmock.Request, event: dict[str, Any]) -> bool:
        meta = event["object"].get("metadata", {})
        return (request.namespace in (None, meta.get("namespace"))
                and request.name in (None, meta.get("name")))

    def _latest_version(self) -> int:
        return self._log[-1][0] if self._log else 0

    # One write, under the lock: returns (HTTP code, object to answer with, watch event type).
    def _write(self, request: kmock.Request) -> tuple[int, dict[str, Any], str | None]:
        res = request.resource
        if request.method == "POST" and request.name is None:
            return self._create(res, request)
        if request.params.get("dryRun") == "All":  # the operator dry-runs creates only
            raise kmock.KubernetesError(status=501, reason="NotImplemented", message="dry runs of updates")
        key = (res, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        old = self.objects[key].raw
        if request.method == "DELETE":
            return self._delete(key, old)
        if request.subresource not in (None, "status"):
            raise kmock.KubernetesNotFoundError(message=f"no subresource {request.subresource}")
        new = self._changed(res, request, old)
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        for field in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp"):
            if field in old_meta:
                meta[field] = old_meta[field]
        if res in self._status_subresource:  # status and the rest are written separately
            if request.subresource == "status":
                new = {**copy.deepcopy(old), "status": new.get("status")}
                if new["status"] is None:
                    del new["status"]
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        new = self._defaulted(res, new)
        if res.plural not in NO_GENERATION:
            new["metadata"]["generation"] = old_meta.get("generation", 1) + (
                _essence(new) != _essence(old))
        new["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
        new["metadata"]["managedFields"] = old_meta.get("managedFields", [])
        if new == old:
            return 200, old, None
        new["metadata"]["managedFields"] = managed_fields(
            old, new, _manager(request), request.subresource, old.get("apiVersion", ""))
        new["metadata"]["resourceVersion"] = str(next(self._versions))
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].delete()
            return 200, new, "DELETED"
        self.objects[key].patch(None)  # a new version in the history, then its content
        self.objects[key].history[-1] = new
        return 200, new, "MODIFIED"

    def _changed(self, res: Any, request: kmock.Request, old: dict[str, Any]) -> dict[str, Any]:
        body = request.data
        if request.method == "PUT":
            sent_version = (body.get("metadata") or {}).get("resourceVersion")
            if sent_version and sent_version != old["metadata"]["resourceVersion"]:
                raise self._conflict(request)
            return copy.deepcopy(body)
        content_type = request.headers.get("Content-Type", "").split(";")[0]
        if content_type == "application/json-patch+json":
            try:
                return jsonpatch.apply_patch(copy.deepcopy(old), body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        if content_type in ("application/merge-patch+json",
                            "application/strategic-merge-patch+json"):
            sent_version = (body.get("metadata") or {}).get("resourceVersion")
            if sent_version and sent_version != old["metadata"]["resourceVersion"]:
                raise self._conflict(request)
            return dict(kmock_dicts.merge_patch_dict(copy.deepcopy(old), body))
        raise kmock.KubernetesError(status=415, reason="UnsupportedMediaType",
                                    message=f"unsupported patch type {content_type!r}")

    def _create(self, res: Any, request: kmock.Request) -> tuple[int, dict[str, Any], str]:
        obj = copy.deepcopy(request.data)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        namespace = request.namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        key = (res, namespace, meta.get("name"))
        if key in self.objects and not self.objects[key].deleted:
            raise kmock.KubernetesError(status=409, reason="AlreadyExists",
                                        message=f"{res.plural} {meta['name']!r} already exists")
        if res in self._status_subresource:
            obj.pop("status", None)
        if request.params.get("dryRun") == "All":
            return 201, self._defaulted(res, obj), None
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(),
                    resourceVersion=str(next(self._versions)))
        if res.plural not in NO_GENERATION:
            meta["generation"] = 1
        obj = self._defaulted(res, obj)
        obj["metadata"]["managedFields"] = managed_fields(
            None, obj, _manager(request), None, obj.get("apiVersion", ""))
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        return 201, obj, "ADDED"

    def _delete(self, key: Any, old: dict[str, Any]) -> tuple[int, dict[str, Any], str | None]:
        meta = old["metadata"]
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return 200, old, None
            new = copy.deepcopy(old)
            new["metadata"].update(deletionTimestamp=_now(),
                                   resourceVersion=str(next(self._versions)))
            self.objects[key].patch(None)
            self.objects[key].history[-1] = new
            return 200, new, "MODIFIED"
        self.objects[key].delete()
        return 200, old, "DELETED"

    def _defaulted(self, res: Any, obj: dict[str, Any]) -> dict[str, Any]:
        """Server defaults, then validation (422 on an invalid object)."""
        if res in self._schemas:
            obj = schema_defaults(self._schemas[res], obj)
            errors = sorted(jsonschema.Draft4Validator(self._schemas[res]).iter_errors(obj),
                            key=str)
            if errors:
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message=errors[0].message)
        if (res.group, res.plural) == ("apps", "deployments"):
            obj.setdefault("spec", {}).setdefault("replicas", 1)
        if (res.group, res.plural) in _VALIDATED_KINDS:
            try:
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid",
                                            message=f"{'.'.join(map(str, exc.path))}: "
                                                    f"{exc.message}")
        return obj

    def _conflict(self, request: kmock.Request) -> kmock.KubernetesError:
        return kmock.KubernetesError(
            status=409, reason="Conflict",
            message=f"Operation cannot be fulfilled on {request.resource.plural} "
                    f"{request.name!r}: the object has been modified; please apply your changes "
                    f"to the latest version and try again")
