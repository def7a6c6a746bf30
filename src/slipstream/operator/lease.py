"""One writer at a time (issue 33): a Lease the acting operator holds, checked before every
write the operator makes with its own client.

kopf peering picks the replica that acts, but only as fast as each replica reads the peering
object: a replica stopped or cut off from the API server for longer than its peering lifetime
comes back believing it still acts, with its timers due, while the replica that took over
acts too. Measured before this fence: after a 50 s blackout two operators both wrote the
Deployment. The fence is a ``coordination.k8s.io/v1`` Lease (named like the peering object,
in the operator's namespace): a write goes out only while this process holds it, renewed
within :attr:`WriteFence.renew_seconds`; it is taken only when free or expired
(``renewTime`` + ``leaseDurationSeconds`` past), with the Lease's ``resourceVersion`` as the
precondition, so of two replicas that both find it expired one wins and the other gets 409.
A replica that comes back after a partition finds its own hold older than the renew period,
reads the Lease, sees the other holder and writes nothing until that one lets it lapse.

What it cannot fence: a process stopped between the check and the write's arrival. The
Deployment's replicas write carries the ``resourceVersion`` it read (scaling.apply_scale), so
such a late write fails with 409 if the other replica wrote in between.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from slipstream.operator.fleet import epoch_seconds
from slipstream.operator.kube import LEASES, ApiError, Kube

DEFAULT_LEASE_SECONDS = 15


class NotLeaseHolder(ApiError):
    """A write refused by the fence: another operator replica holds the Lease. A 409, so callers
    retry later as after any conflict."""

    def __init__(self, lease: str, holder: str, until: float):
        super().__init__(409, "NotLeaseHolder",
                         f"Lease {lease} is held by {holder} until {until - time.time():.0f}s "
                         f"from now: this replica writes nothing until it lapses")


def may_take(lease: Mapping[str, Any] | None, identity: str, now: float) -> bool:
    """Whether ``identity`` may take or renew ``lease`` (a Lease object, None: none yet) at
    ``now`` (epoch seconds): it is ours, unheld, or expired (pure)."""
    if lease is None:
        return True
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    if not holder or holder == identity:
        return True
    renewed = epoch_seconds(spec.get("renewTime")) or epoch_seconds(spec.get("acquireTime"))
    return renewed is None or now >= renewed + float(spec.get("leaseDurationSeconds") or 0)


def lease_spec(previous: Mapping[str, Any] | None, identity: str, now: float,
               duration: int) -> dict[str, Any]:
    """The Lease's ``spec`` after ``identity`` takes or renews it at ``now`` (epoch seconds;
    pure). ``leaseTransitions`` counts changes of holder."""
    old = dict((previous or {}).get("spec") or {})
    stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%S.%fZ")  # MicroTime
    taken = old.get("holderIdentity") != identity
    return {**old, "holderIdentity": identity, "leaseDurationSeconds": int(duration),
            "renewTime": stamp,
            "acquireTime": stamp if taken else old.get("acquireTime", stamp),
            "leaseTransitions": int(old.get("leaseTransitions") or 0) + (1 if taken and old else 0)}


@dataclass
class WriteFence:
    """The Lease ``namespace/name`` held by ``identity``; :meth:`check` before each write.

    kube: a client of its own (not the fenced one). duration: ``leaseDurationSeconds``.
    renew_seconds: how old a hold may be before a write renews it (a third of duration); the
    hold is timed on the monotonic clock, which runs on while the process is stopped.
    """

    kube: Kube
    namespace: str
    name: str
    identity: str
    duration: int = DEFAULT_LEASE_SECONDS
    renew_seconds: float | None = None
    clock: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic
    _held_at: float | None = field(default=None, init=False)

    async def check(self) -> None:
        """Returns when this process holds the Lease (renewing or taking it if needed).
        Raises NotLeaseHolder, or kube.ApiError when the Lease cannot be read or written."""
        renew = self.renew_seconds if self.renew_seconds is not None else self.duration / 3
        if self._held_at is not None and self.monotonic() - self._held_at < renew:
            return
        self._held_at = None
        started = self.monotonic()
        lease = await self.kube.get(LEASES, self.namespace, self.name)
        now = self.clock()
        if not may_take(lease, self.identity, now):
            spec = lease["spec"]
            renewed = epoch_seconds(spec.get("renewTime")) or now
            raise NotLeaseHolder(f"{self.namespace}/{self.name}", spec.get("holderIdentity"),
                                 renewed + float(spec.get("leaseDurationSeconds") or 0))
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": lease_spec(lease, self.identity, now, self.duration)}
        if lease is None:
            await self.kube.create(LEASES, body)
        else:  # resourceVersion: of two replicas taking an expired Lease, one gets 409
            body["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
            await self.kube.replace(LEASES, body)
        self._held_at = started  # the hold counts from before the read, never later

    async def release(self) -> None:
        """Give the Lease up (an operator shutting down: its successor, e.g. the next pod of a
        Recreate rollout, need not wait out the duration). Best effort: errors are swallowed."""
        if self._held_at is None:
            return
        self._held_at = None
        try:
            lease = await self.kube.get(LEASES, self.namespace, self.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            lease["spec"]["holderIdentity"] = ""
            await self.kube.replace(LEASES, lease)
        except ApiError:
            pass
