"""kopf handlers: thin triggers of :func:`slipstream.operator.reconcile.reconcile`.

``register(registry, config)`` puts them on a registry (the CLI's, or a test's own).
Triggers: create/update/resume of an InferenceService, a periodic resync (timer), any
change to a Deployment, LeaderWorkerSet or Service labelled ``app.kubernetes.io/managed-by=slipstream-operator``
(so a hand-deleted or hand-edited child comes back within moments), and any change to a model
pod (so Ready says at once why pods do not run: unschedulable, image pull, crash loop). One asyncio lock per
InferenceService keeps these from reconciling the same object at once in this process; kopf
peering keeps a second operator replica from acting at all, and the write fence (lease.py)
keeps it from writing in the moments when peering has not yet caught up (after a partition).
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import kopf

from slipstream.api_types.parallelism import LWS_GROUP, LWS_PLURAL, LWS_VERSION

from slipstream.operator import autoscaling_loop
from slipstream.operator.kube import CLUSTER_PEERINGS, PEERINGS, ApiError, Kube
from slipstream.operator.lease import DEFAULT_LEASE_SECONDS, WriteFence
from slipstream.operator.reconcile import reconcile, retry_delay
from slipstream.operator.resources import GROUP, INSTANCE_LABEL, KIND, MANAGED_BY, PLURAL, \
    VERSION

CHILD_LABELS = {"app.kubernetes.io/managed-by": MANAGED_BY}


@dataclass(frozen=True, slots=True)
class WatchTimeouts:
    """Bounds on kopf's watch streams, in seconds, so a half-open connection (the server gone
    without a FIN: the kopf default waits 70 s, or forever without a server timeout) is noticed.

    server: ``timeoutSeconds`` of each watch: the API server ends it, kopf re-watches from the
    last resourceVersion (nothing is lost). client: the client gives up on a stream the server
    did not end, and on one that sent nothing (not even a bookmark) for this long; then kopf
    re-watches, or re-lists if that resourceVersion is too old. connect: to open a stream.
    backoff: the pause between two streams (no API flood when each fails at once).
    """

    # An integer: the API server refuses ``timeoutSeconds=30.0`` with a 400 (ParseInt).
    server: int = 30
    client: float = 40.0
    connect: float = 10.0
    backoff: float = 1.0


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """resync_seconds: period of the level-based check of every InferenceService.
    autoscale_seconds: period of the autoscaler's tick (objects with autoscaling on).
    cluster_domain: for ``status.url``. namespaces: the served ones (empty: all), for the
    peering objects. login: kopf's credentials (a kopf login handler). kube: makes our API
    client. watch: the watch streams' timeouts. Tests pass their own login, kube and watch.
    lease_namespace: where the write fence's Lease lives (named like the peering object; None:
    no fence, as with --standalone). lease_seconds: its ``leaseDurationSeconds``.
    peering_lifetime: seconds a silent peer counts as alive (kopf's ``peering.lifetime``).
    identity: this replica's name in the Lease and the User-Agent."""

    resync_seconds: float = 60.0
    autoscale_seconds: float = autoscaling_loop.DEFAULT_INTERVAL
    cluster_domain: str = "cluster.local"
    namespaces: tuple[str, ...] = ()
    login: Callable[..., kopf.ConnectionInfo | None] = kopf.login_via_client
    kube: Callable[[], Kube] = Kube.from_environment
    watch: WatchTimeouts = field(default_factory=WatchTimeouts)
    lease_namespace: str | None = None
    lease_seconds: int = DEFAULT_LEASE_SECONDS
    peering_lifetime: int = 60
    identity: str = field(default_factory=lambda: os.environ.get("POD_NAME")
                          or f"{socket.gethostname()}-{os.getpid()}")


async def ensure_peering(kube: Kube, name: str, namespaces: tuple[str, ...] | None,
                         logger: kopf.Logger | logging.Logger) -> None:
    """Create kopf's peering object(s) ``name`` if missing (kopf only patches them): one
    ClusterKopfPeering for a cluster-wide operator (``namespaces`` None), else a KopfPeering in
    each literal namespace. Needs the CRDs in crds/kopf-peering.yaml."""
    targets = [(CLUSTER_PEERINGS, "ClusterKopfPeering", None)] if namespaces is None else [
        (PEERINGS, "KopfPeering", ns) for ns in namespaces if not any(c in ns for c in "*?[!")]
    for resource, kind, namespace in targets:
        if await kube.get(resource, namespace, name) is not None:
            continue
        meta = {"name": name, **({"namespace": namespace} if namespace else {})}
        try:
            await kube.create(resource, {"apiVersion": "kopf.dev/v1", "kind": kind,
                                         "metadata": meta})
            logger.info(f"created {kind} {name} for leader election")
        except ApiError as exc:
            if exc.status == 404:
                raise kopf.PermanentError(
                    f"{kind} is not a known resource: apply crds/kopf-peering.yaml, or run "
                    f"with --standalone (a single replica, no leader election)") from exc
            if exc.status != 409:  # 409: another replica created it first
                raise


def configure(settings: kopf.OperatorSettings, watch: WatchTimeouts = WatchTimeouts()) -> None:
    """kopf's storage under our own names; Events only for our own messages + warnings, posted
    as ``slipstream-operator`` (``kubectl describe``'s "From"; kopf would say ``kopf``) by this
    pod; bounded watch streams (:class:`WatchTimeouts`)."""
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = os.environ.get("POD_NAME") or socket.gethostname()
    settings.posting.event_name_prefix = f"{MANAGED_BY}-"
    settings.watching.server_timeout = int(watch.server)
    settings.watching.client_timeout = watch.client
    settings.watching.inactivity_timeout = watch.client
    settings.watching.connect_timeout = watch.connect
    settings.watching.reconnect_backoff = watch.backoff


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register the operator's handlers on ``registry``."""
    resource = dict(group=GROUP, version=VERSION, plural=PLURAL)
    locks: collections.defaultdict[tuple[str, str], asyncio.Lock] = \
        collections.defaultdict(asyncio.Lock)
    retries: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def run(memo: Any, namespace: str, name: str, logger: kopf.Logger,
                  retry: int = 0) -> None:
        async with locks[namespace, name]:
            outcome = await reconcile(memo.kube, namespace, name, retry=retry,
                                      cluster_domain=config.cluster_domain)
        for action in outcome.actions if outcome else ():
            logger.info(action)

    # A registry of our own has none of kopf's default login handlers.
    kopf.on.login(id="login", registry=registry)(config.login)

    @kopf.on.startup(registry=registry)
    async def start(settings: kopf.OperatorSettings, memo: Any, logger: kopf.Logger,
                    **_: Any) -> None:
        configure(settings, config.watch)
        settings.peering.lifetime = config.peering_lifetime
        memo.kube = config.kube()
        memo.kube.identify(config.identity)
        if not settings.peering.standalone and settings.peering.name:
            await ensure_peering(memo.kube, settings.peering.name,
                                 None if settings.peering.clusterwide else config.namespaces,
                                 logger)
            if config.lease_namespace:
                lease_kube = config.kube()
                lease_kube.identify(config.identity)
                memo.fence = WriteFence(lease_kube, config.lease_namespace, settings.peering.name,
                                        config.identity, config.lease_seconds)
                memo.kube.fence = memo.fence.check

    @kopf.on.cleanup(registry=registry)
    async def stop(memo: Any, **_: Any) -> None:
        for task in retries.values():
            task.cancel()
        fence = getattr(memo, "fence", None)
        if fence is not None:
            await fence.release()
        for holder in (getattr(memo, "kube", None), getattr(getattr(memo, "fence", None), "kube", None)):
            if holder is not None:
                await holder.close()

    async def retry_later(memo: Any, namespace: str, name: str, logger: kopf.Logger) -> None:
        """Reconcile again after retry_delay(0), (1) … seconds (1, 2, 4 … 60, kopf's own
        schedule) until it succeeds or fails for good."""
        for retry in itertools.count(1):
            await asyncio.sleep(retry_delay(retry - 1))
            try:
                await run(memo, namespace, name, logger, retry)
                return
            except kopf.TemporaryError as exc:
                logger.warning(f"{exc}; retrying in {retry_delay(retry):.0f}s or at the next change")
            except kopf.PermanentError:
                return

    @kopf.on.resume(**resource, id="reconcile", registry=registry)
    @kopf.on.create(**resource, id="reconcile", registry=registry)
    @kopf.on.update(**resource, id="reconcile", registry=registry)
    async def reconcile_on_change(namespace: str, name: str, memo: Any,
                                  logger: kopf.Logger, **_: Any) -> None:
        # kopf keeps a handler that raised TemporaryError delayed across later changes, so a
        # fixed spec would wait out the backoff (up to 60 s). The retries run here instead,
        # and each change cancels them and reconciles at once.
        key = (namespace, name)
        pending = retries.pop(key, None)
        if pending is not None:
            pending.cancel()
        try:
            await run(memo, namespace, name, logger)
        except kopf.TemporaryError as exc:
            logger.warning(f"{exc}; retrying in {retry_delay(0):.0f}s or at the next change")
            retries[key] = asyncio.create_task(retry_later(memo, namespace, name, logger))

    @kopf.timer(**resource, id="resync", interval=config.resync_seconds,
                initial_delay=config.resync_seconds, registry=registry)
    async def resync(namespace: str, name: str, memo: Any, retry: int, logger: kopf.Logger,
                     **_: Any) -> None:
        await run(memo, namespace, name, logger, retry)

    autoscaling_loop.register(registry, interval=config.autoscale_seconds)

    @kopf.on.event("apps", "v1", "deployments", id="child", labels=CHILD_LABELS,
                   registry=registry)
    # Served only where LWS is installed; kopf watches a resource once the cluster serves it.
    @kopf.on.event(LWS_GROUP, LWS_VERSION, LWS_PLURAL, id="child", labels=CHILD_LABELS,
                   registry=registry)
    @kopf.on.event("", "v1", "services", id="child", labels=CHILD_LABELS, registry=registry)
    async def child_changed(body: kopf.Body, namespace: str, memo: Any,
                            logger: kopf.Logger, **_: Any) -> None:
        owners = [ref["name"] for ref in body.metadata.get("ownerReferences") or ()
                  if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(GROUP)]
        for owner in owners:
            try:
                await run(memo, namespace, owner, logger)
            except (kopf.TemporaryError, kopf.PermanentError) as exc:
                # The owner's own handlers and the resync retry; this trigger only hurries.
                logger.debug(f"reconcile of {owner} after a child changed: {exc}")

    @kopf.on.event("", "v1", "pods", id="pod", labels=CHILD_LABELS, registry=registry)
    async def pod_changed(body: kopf.Body, namespace: str, memo: Any, logger: kopf.Logger,
                          **_: Any) -> None:
        # A pod that cannot be scheduled or pull its image changes no Deployment field: the
        # Ready condition learns why from the pod itself.
        owner = (body.metadata.get("labels") or {}).get(INSTANCE_LABEL)
        if not owner:
            return
        try:
            await run(memo, namespace, owner, logger)
        except (kopf.TemporaryError, kopf.PermanentError) as exc:
            logger.debug(f"reconcile of {owner} after a pod changed: {exc}")

    @kopf.on.delete(**resource, id="deleted", optional=True, registry=registry)
    async def deleted(namespace: str, name: str, logger: kopf.Logger, **_: Any) -> None:
        locks.pop((namespace, name), None)
        pending = retries.pop((namespace, name), None)
        if pending is not None:
            pending.cancel()
        logger.info("children go with their owner references (garbage collection)")
