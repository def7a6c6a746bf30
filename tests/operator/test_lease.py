"""The write fence (operator/lease.py): who may take the Lease (pure), and the fence against
the API emulator: a second replica's write is refused while the first holds the Lease, and
goes out once that Lease lapsed."""
from __future__ import annotations

import pytest

from slipstream.operator.kube import DEPLOYMENTS, LEASES, Kube
from slipstream.operator.lease import NotLeaseHolder, WriteFence, lease_spec, may_take

T0 = 1_800_000_000.0


def lease(holder: str, renewed: float, duration: int = 15) -> dict:
    return {"spec": lease_spec(None, holder, renewed, duration)}


def test_may_take_a_lease_that_is_missing_ours_or_expired_but_not_anothers_live_one():
    assert may_take(None, "a", T0)
    assert may_take(lease("a", T0), "a", T0 + 1)
    assert not may_take(lease("b", T0), "a", T0 + 14.9)
    assert may_take(lease("b", T0), "a", T0 + 15)
    assert may_take({"spec": {}}, "a", T0)  # unheld


def test_lease_spec_counts_transitions_and_keeps_the_acquire_time_on_renewal():
    first = lease_spec(None, "a", T0, 15)
    assert first["holderIdentity"] == "a" and first["leaseTransitions"] == 0
    renewed = lease_spec({"spec": first}, "a", T0 + 5, 15)
    assert renewed["acquireTime"] == first["acquireTime"] != renewed["renewTime"]
    taken = lease_spec({"spec": renewed}, "b", T0 + 30, 15)
    assert taken["leaseTransitions"] == 1 and taken["acquireTime"] == taken["renewTime"]


class Clocks:
    def __init__(self) -> None:
        self.wall, self.mono = T0, 100.0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


async def test_only_the_holder_writes_and_the_other_takes_over_once_the_lease_lapsed(kube: Kube):
    clocks = Clocks()

    def fence(identity: str) -> WriteFence:
        return WriteFence(kube, "default", "slipstream-operator", identity, duration=6,
                          clock=lambda: clocks.wall, monotonic=lambda: clocks.mono)

    a, b = fence("a"), fence("b")
    await a.check()
    with pytest.raises(NotLeaseHolder) as refused:
        await b.check()
    assert refused.value.status == 409 and "held by a" in refused.value.message
    clocks.advance(3)
    await a.check()  # renewed: older than a third of 6 s
    clocks.advance(5.9)
    with pytest.raises(NotLeaseHolder):
        await b.check()
    clocks.advance(0.2)  # 6 s after a's renewal: lapsed
    await b.check()
    with pytest.raises(NotLeaseHolder):
        await a.check()  # a, back after a pause, finds b holding it and writes nothing
    stored = await kube.get(LEASES, "default", "slipstream-operator")
    assert stored["spec"]["holderIdentity"] == "b" and stored["spec"]["leaseTransitions"] == 1


async def test_a_fenced_client_sends_no_write_while_another_replica_holds_the_lease(kube: Kube):
    other = WriteFence(kube, "default", "slipstream-operator", "other")
    await other.check()
    fenced = Kube(kube.server)
    fenced.fence = WriteFence(kube, "default", "slipstream-operator", "me").check
    try:
        with pytest.raises(NotLeaseHolder):
            await fenced.create(DEPLOYMENTS, {"apiVersion": "apps/v1", "kind": "Deployment",
                                              "metadata": {"name": "x", "namespace": "default"}})
        assert await fenced.get(DEPLOYMENTS, "default", "x") is None  # reads are not fenced
    finally:
        await fenced.close()


async def test_a_released_lease_is_taken_at_once(kube: Kube):
    a = WriteFence(kube, "default", "slipstream-operator", "a")
    b = WriteFence(kube, "default", "slipstream-operator", "b")
    await a.check()
    await a.release()  # a shutting down
    await b.check()  # no wait for the duration
    stored = await kube.get(LEASES, "default", "slipstream-operator")
    assert stored["spec"]["holderIdentity"] == "b"
