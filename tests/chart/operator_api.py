"""The Kubernetes API calls `slipstream operator run` makes, collected from its code, so the
chart's RBAC can be checked against them (tests/test_chart.py).

Two sources, both read from the code rather than written down by hand:

* Our REST client (operator/kube.py). Every call ``<…kube>.<method>(RESOURCE, …)`` in
  operator/*.py is found in the syntax tree; ``METHOD_VERBS`` turns the client's method into an
  RBAC verb, the first argument (a kube.py ``Resource`` constant, directly or through a
  variable or parameter, or a function that picks one such as ``workload_resource``) gives the
  resource, ``subresource=`` the subresource. Collection fails
  (:class:`CollectionError`) on a client method the map does not know, a raw ``request()``
  outside kube.py, or a call whose resource cannot be told — so a new kind of call cannot slip
  past the RBAC test unnoticed.
* kopf. The resources come from the handlers ``handlers.register`` puts on a kopf registry;
  what kopf does with them, and its own calls (peering, Events, observers), from kopf's source,
  cited at ``KOPF_*`` below.

And what the operator grants: the Role it renders for each gateway
(``gateway_resources.GATEWAY_RULES``) must hold exactly the calls the gateway makes with the
Kubernetes client (:func:`gateway_calls`, collected from server/gateway/*.py), and the operator
must hold every one of them itself, or the API server refuses to create that Role (RBAC
escalation prevention).
"""
from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import kopf

from slipstream.operator import kube
from slipstream.operator.gateway_resources import GATEWAY_RULES
from slipstream.operator.handlers import OperatorConfig, register

OPERATOR_DIR = pathlib.Path(kube.__file__).resolve().parent
GATEWAY_DIR = OPERATOR_DIR.parent / "server" / "gateway"

# The official Kubernetes client's API classes → API group, and its resource names (snake
# case, singular, as in ``list_namespaced_endpoint_slice``) → RBAC plurals. A call on a
# resource missing here stops the collection (teach it the new one).
CLIENT_API_GROUPS = {"CoreV1Api": "", "AppsV1Api": "apps", "DiscoveryV1Api": "discovery.k8s.io",
                     "CoordinationV1Api": "coordination.k8s.io"}
CLIENT_RESOURCES = {"endpoint_slice": ("discovery.k8s.io", "endpointslices"),
                    "pod": ("", "pods"), "service": ("", "services"),
                    "endpoints": ("", "endpoints"), "lease": ("coordination.k8s.io", "leases")}
CLIENT_VERBS = {"list": "list", "read": "get", "create": "create", "replace": "update",
                "patch": "patch", "delete": "delete"}

# kube.Kube's methods → the RBAC verb of the HTTP call each makes.
METHOD_VERBS = {"get": "get", "list": "list", "create": "create", "replace": "update",
                "merge_patch": "patch", "delete": "delete"}
# Kube's methods that make no API call of their own (or are the transport under the others),
# or only one that needs no grant: server_version reads /version, which the default ClusterRole
# system:public-info-viewer opens to everyone.
# image_volumes_admitted's one call is a self.create(DEPLOYMENTS, ...) dry run in kube.py, collected
# there as the create it is checked as.
NO_CALL_METHODS = {"close", "request", "from_environment", "server_version", "image_volumes_admitted",
                   "identify"}

# Resources without a namespace: only a ClusterRole bound cluster-wide can grant them.
CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces"),
                  ("kopf.dev", "clusterkopfpeerings")}
# kopf's peering object, by the operator's scope (handlers.ensure_peering, kopf's peering.py).
PEERING = {True: ("kopf.dev", "clusterkopfpeerings"), False: ("kopf.dev", "kopfpeerings")}
# The write fence's Lease (operator/lease.py): with peering only, in the operator's own namespace.
LEASE = ("coordination.k8s.io", "leases")

# kopf/_core/reactor/processing.py: handled objects get finalizers and progress annotations
# (merge/JSON patches, kopf/_cogs/clients/patching.py); every served resource is listed and
# watched (kopf/_cogs/clients/watching.py).
KOPF_HANDLED_VERBS = ("list", "watch", "patch")
KOPF_WATCHED_VERBS = ("list", "watch")
# kopf/_core/engines/peering.py: the peering object is watched and patched with keep-alives.
KOPF_PEERING_VERBS = ("list", "watch", "patch")
# kopf/_cogs/clients/events.py: handler failures and kopf.event() POST core/v1 Events.
KOPF_EVENTS = ("", "events", "create")
# kopf/_core/reactor/observation.py: resource_observer lists and watches CRDs always;
# namespace_observer lists and watches namespaces unless the operator is cluster-wide.
KOPF_CRDS = ("apiextensions.k8s.io", "customresourcedefinitions")
KOPF_NAMESPACES = ("", "namespaces")

# kopf.adopt (render.render_children) sets ``blockOwnerDeletion: true`` on the children's owner
# reference; where the OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift,
# and the test cluster of e2e/cluster), that needs `update` on the owner's finalizers
# subresource. Not a call the operator makes: a condition the API server puts on its creates.
ADOPTION = ("slipstream.dev", "inferenceservices/finalizers", "update")

# Calls operator/README.md announces but the code does not make yet: granted ahead so the chart
# works the day they land (so they count as required). The autoscaler's tick lists an
# InferenceService's pods to scrape them ("Where the autoscaler hooks in", issue 6). Once the
# code makes a call, the collection finds it and its entry here is redundant.
ANNOUNCED = {("", "pods", "list")}


class CollectionError(Exception):
    """A call the collector cannot map to an RBAC rule; the message says where and what to do."""


@dataclass(frozen=True, order=True, slots=True)
class Permission:
    """One RBAC grant: API group ('' for core), resource ('deployments', 'x/status'), verb."""

    group: str
    resource: str
    verb: str

    @property
    def cluster_scoped(self) -> bool:
        return (self.group, self.resource.split("/")[0]) in CLUSTER_SCOPED


def _resources() -> dict[str, kube.Resource]:
    return {name: value for name, value in vars(kube).items()
            if isinstance(value, kube.Resource)}


def check_client_surface() -> None:
    """Fail when kube.Kube has a public method the verb map does not know."""
    methods = {name for name, value in vars(kube.Kube).items()
               if callable(value) or isinstance(value, classmethod)} - {"__init__"}
    unknown = {m for m in methods if not m.startswith("_")} - set(METHOD_VERBS) - NO_CALL_METHODS
    if unknown:
        raise CollectionError(f"kube.Kube has method(s) {sorted(unknown)} that METHOD_VERBS in "
                              f"{__file__} does not map to an RBAC verb; add them")


class _Module:
    """One operator module's syntax tree, with what resolving a resource argument needs."""

    def __init__(self, path: pathlib.Path, resources: dict[str, kube.Resource],
                 choosers: dict[str, set[str]] | None = None):
        self.path, self.resources, self.choosers = path, resources, choosers or {}
        self.tree = ast.parse(path.read_text(), filename=str(path))
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.functions = {n.name: n for n in ast.walk(self.tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def where(self, node: ast.AST) -> str:
        path = self.path.relative_to(OPERATOR_DIR.parent) \
            if self.path.is_relative_to(OPERATOR_DIR.parent) else self.path
        return f"{path}:{getattr(node, 'lineno', '?')}"

    def enclosing(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    def constant(self, expr: ast.AST) -> str | None:
        """The Resource constant ``expr`` names (``PODS``, ``kube.PODS``), or None."""
        if isinstance(expr, ast.Name) and expr.id in self.resources:
            return expr.id
        if isinstance(expr, ast.Attribute) and expr.attr in self.resources:
            return expr.attr
        return None

    def resolve(self, expr: ast.AST, depth: int = 0) -> set[str]:
        """The Resource constants ``expr`` can hold: itself; a parameter → the arguments at the
        function's call sites in this module; another variable → the constants its function
        mentions (an over-approximation: it can only ask for more rules, never hide one)."""
        name = self.constant(expr)
        if name or depth > 3:
            return {name} if name else set()
        if isinstance(expr, ast.Subscript):  # workload_resource(spec)[0]
            return self.resolve(expr.value, depth + 1)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            return set(self.choosers.get(expr.func.id, ()))
        if not isinstance(expr, ast.Name):
            return set()
        function = self.enclosing(expr)
        if function is None:
            return set()
        params = [a.arg for a in function.args.posonlyargs + function.args.args]
        if expr.id in params + [a.arg for a in function.args.kwonlyargs]:
            index = params.index(expr.id) if expr.id in params else None
            found: set[str] = set()
            for call in ast.walk(self.tree):
                if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) \
                        and call.func.id == function.name:
                    args = [k.value for k in call.keywords if k.arg == expr.id]
                    if index is not None and index < len(call.args):
                        args.append(call.args[index])
                    for arg in args:
                        found |= self.resolve(arg, depth + 1)
            return found
        mentioned = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
        return {n for n in mentioned if n in self.resources}.union(
            *(self.choosers[n] for n in mentioned if n in self.choosers))


def resource_choosers(paths: Iterable[pathlib.Path] | None = None) -> dict[str, set[str]]:
    """Functions of the operator that pick a resource (their return annotation names
    ``Resource``, e.g. group_resources.workload_resource: Deployment or LeaderWorkerSet) → the
    Resource constants their body can return (every one it mentions: an over-approximation)."""
    resources, found = _resources(), {}
    for path in sorted(paths if paths is not None else OPERATOR_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None \
                    and "Resource" in ast.unparse(node.returns):
                found[node.name] = {n.id for n in ast.walk(node)
                                    if isinstance(n, ast.Name) and n.id in resources}
    return found


def client_calls(paths: Iterable[pathlib.Path] | None = None) -> Iterator[tuple[str, Permission]]:
    """(where, permission) for every call of our REST client in the operator's modules."""
    check_client_surface()
    resources, choosers = _resources(), resource_choosers()
    for path in sorted(paths if paths is not None else OPERATOR_DIR.glob("*.py")):
        module = _Module(path, resources, choosers)
        for call in ast.walk(module.tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                continue
            receiver, method = ast.unparse(call.func.value), call.func.attr
            if method == "request" and path.name != "kube.py":
                raise CollectionError(f"{module.where(call)}: {receiver}.request(...) bypasses "
                                      f"the client's typed methods; use get/list/create/replace/"
                                      f"merge_patch so the RBAC test can see the call")
            first = call.args[0] if call.args else next(
                (k.value for k in call.keywords if k.arg == "resource"), None)
            by_name = receiver == "kube" or receiver.endswith(".kube")
            by_argument = first is not None and module.constant(first) is not None
            if not (by_name or by_argument) or method in NO_CALL_METHODS:
                continue
            if method not in METHOD_VERBS:
                raise CollectionError(f"{module.where(call)}: {receiver}.{method}(...) is not a "
                                      f"method METHOD_VERBS knows")
            names = module.resolve(first) if first is not None else set()
            if not names:
                raise CollectionError(f"{module.where(call)}: cannot tell which resource "
                                      f"{receiver}.{method}(...) calls; pass a kube.py Resource "
                                      f"constant (or a parameter given one)")
            sub = next((k.value for k in call.keywords if k.arg == "subresource"), None)
            if sub is not None and not (isinstance(sub, ast.Constant) and
                                        isinstance(sub.value, (str, type(None)))):
                raise CollectionError(f"{module.where(call)}: subresource must be a literal")
            suffix = f"/{sub.value}" if sub is not None and sub.value else ""
            for name in sorted(names):
                res = resources[name]
                yield module.where(call), Permission(res.group, res.plural + suffix,
                                                     METHOD_VERBS[method])


def kopf_handler_calls() -> set[Permission]:
    """What kopf calls for the handlers the operator registers."""
    registry = kopf.OperatorRegistry()
    register(registry, OperatorConfig())
    found: set[Permission] = set()
    groups = ((registry._changing, KOPF_HANDLED_VERBS), (registry._spawning, KOPF_HANDLED_VERBS),
              (registry._watching, KOPF_WATCHED_VERBS), (registry._indexing, KOPF_WATCHED_VERBS))
    for handlers, verbs in groups:
        for handler in handlers.get_all_handlers():
            selector = handler.selector
            plural = selector.plural or selector.any_name
            if not plural or not plural.islower() or selector.group is None:
                raise CollectionError(f"kopf handler {handler.id!r} names its resource as "
                                      f"{selector!r}; give group, version and plural")
            found |= {Permission(selector.group, plural, verb) for verb in verbs}
    if registry._webhooks.get_all_handlers():
        raise CollectionError("kopf admission webhooks need rules for webhook configurations; "
                              "teach operator_api.py about them")
    return found


def granted() -> set[Permission]:
    """What the operator grants the gateways (the rules of the Role it renders)."""
    return {Permission(group, resource, verb) for rule in GATEWAY_RULES
            for group in rule["apiGroups"] for resource in rule["resources"]
            for verb in rule["verbs"]}


def gateway_calls(paths: Iterable[pathlib.Path] | None = None) -> Iterator[tuple[str, Permission]]:
    """(where, permission) for every Kubernetes client call in the gateway's modules: a method
    ``<verb>_namespaced_<resource>`` (``list_namespaced_endpoint_slice``) called, or passed to
    ``watch.Watch().stream(...)`` (a watch; the stream lists first, with the same verb check as
    a list call). Raises CollectionError for a resource or verb it cannot map."""
    import re

    pattern = re.compile(r"^(list|read|create|replace|patch|delete)_namespaced_(\w+)$")
    for path in sorted(paths if paths is not None else GATEWAY_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        where = f"{path.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            found = pattern.match(node.attr)
            if not found and re.match(r"^(list|read|create|replace|patch|delete|watch)_", node.attr) \
                    and "api" in ast.unparse(node.value).lower():
                raise CollectionError(f"{where}:{node.lineno}: {ast.unparse(node)} is a client "
                                      f"call gateway_calls cannot map; teach it")
            if not found:
                continue
            verb, snake = found.groups()
            if snake not in CLIENT_RESOURCES:
                raise CollectionError(f"{where}:{node.lineno}: resource {snake!r} of "
                                      f"{node.attr} is not in CLIENT_RESOURCES; add it")
            group, plural = CLIENT_RESOURCES[snake]
            up = parent.get(node)
            streamed = isinstance(up, ast.Call) and up.args and up.args[0] is node and \
                isinstance(up.func, ast.Attribute) and up.func.attr == "stream"
            yield f"{where}:{node.lineno}", Permission(group, plural, CLIENT_VERBS[verb])
            if streamed:
                yield f"{where}:{node.lineno}", Permission(group, plural, "watch")


def required(*, clusterwide: bool, peering: bool) -> set[Permission]:
    """Every permission `slipstream operator run` needs in one mode: cluster-wide
    (``--all-namespaces``) or namespaced, with or without peering (``--standalone``)."""
    needed = {p for _, p in client_calls()} | kopf_handler_calls()
    needed |= {Permission(*p) for p in ANNOUNCED}
    needed |= granted()  # held to be granted to the gateways
    needed.add(Permission(*KOPF_EVENTS))
    needed.add(Permission(*ADOPTION))
    needed |= {Permission(*KOPF_CRDS, verb) for verb in ("list", "watch")}
    if not clusterwide:
        needed |= {Permission(*KOPF_NAMESPACES, verb) for verb in ("list", "watch")}
    peering_resources = set(PEERING.values()) | {LEASE}
    needed = {p for p in needed if (p.group, p.resource) not in peering_resources}
    if peering:
        group, plural = PEERING[clusterwide]
        ours = {p.verb for _, p in client_calls()
                if (p.group, p.resource) == (group, plural)}
        needed |= {Permission(group, plural, v) for v in ours | set(KOPF_PEERING_VERBS)}
    return needed


def lease_required(*, peering: bool) -> set[Permission]:
    """What the write fence needs in the operator's own namespace (none without peering)."""
    return {p for _, p in client_calls() if (p.group, p.resource) == LEASE} if peering else set()
