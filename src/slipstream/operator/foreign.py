"""Another scaler on the same Deployment (an HPA, KEDA, a GitOps tool, ``kubectl scale
deployment``): how the autoscaler tells, so that it stops writing replicas instead of fighting.

Pure functions of the live Deployment. The API server records which field manager last set each
field (``metadata.managedFields``, Update operations: whoever changes a field takes it over);
every write of the operator names :data:`kube.FIELD_MANAGER`. A foreign scaler is a manager
other than ours that owns ``spec.replicas`` while the count differs from the one the operator
last set. The value test matters: a manager that owns the field with our count (the operator's
own writes before it named a field manager, a one-off ``kubectl scale`` to the same number) is
no fight. Without ``managedFields`` (an old or an emulated server), a count the operator did not
set is all there is to go on.

The writer counts as gone once it has not written for :data:`QUIET_SECONDS`: ``managedFields``
keeps a manager's entry after the manager itself is deleted, so absence cannot be seen directly.
An HPA that still runs and disagrees writes again, and the autoscaler stands back again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from slipstream.operator.fleet import epoch_seconds
from slipstream.operator.kube import FIELD_MANAGER

# Longer than an HPA's 15 s sync and KEDA's 30 s polling, and than the HPA's default 300 s
# scale-down stabilization, during which it may hold still.
QUIET_SECONDS = 330.0


@dataclass(frozen=True, slots=True)
class ReplicasWriter:
    """A field manager that owns a Deployment's ``spec.replicas``: ``manager`` (its name, e.g.
    ``kube-controller-manager`` for an HPA), ``subresource`` (``scale`` when it wrote through
    ``/scale``), ``time`` (its last write, epoch seconds; None when not recorded)."""

    manager: str
    subresource: str | None = None
    time: float | None = None

    def describe(self) -> str:
        via = " through the scale subresource" if self.subresource == "scale" else ""
        return f"{self.manager}{via}"


def replicas_writers(deployment: Mapping[str, Any]) -> list[ReplicasWriter]:
    """The managers that own ``spec.replicas`` of ``deployment`` (usually one), from its
    ``metadata.managedFields``."""
    found = []
    for entry in (deployment.get("metadata") or {}).get("managedFields") or ():
        fields = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in fields:
            found.append(ReplicasWriter(entry.get("manager") or "an unnamed manager",
                                        entry.get("subresource") or None,
                                        epoch_seconds(entry.get("time"))))
    return found


def foreign_writer(deployment: Mapping[str, Any], expected: int | None,
                   ours: str = FIELD_MANAGER, *, owner_only: bool = False,
                   ) -> ReplicasWriter | None:
    """The foreign scaler of ``deployment``, or None.

    expected: the replica count the operator last set (None: not known, e.g. a fresh operator
    with no ``status.desiredReplicas``: nothing is foreign until it is). owner_only: skip the
    count test (a restarted operator that had stood back: its status holds the count it
    wanted, not the one it set).
    """
    live = (deployment.get("spec") or {}).get("replicas", 1)
    if not owner_only and (expected is None or live == expected):
        return None
    meta = deployment.get("metadata") or {}
    if "managedFields" not in meta:
        return ReplicasWriter("an unknown writer")
    others = [w for w in replicas_writers(deployment) if w.manager != ours]
    return others[-1] if others else None


def still_writing(deployment: Mapping[str, Any], writer: ReplicasWriter, now: float,
                  last_change: float | None = None) -> bool:
    """Whether ``writer`` (found by :func:`foreign_writer` earlier) still counts as active at
    ``now`` (epoch seconds): it still owns ``spec.replicas`` and wrote it within
    :data:`QUIET_SECONDS`. ``last_change``: when the count was last seen to change, the measure
    when the server records no time (or no ``managedFields`` at all)."""
    meta = deployment.get("metadata") or {}
    if "managedFields" in meta:
        current = [w for w in replicas_writers(deployment) if w.manager == writer.manager]
        if not current:
            return False
        written = current[-1].time if current[-1].time is not None else last_change
    else:
        written = last_change
    return written is not None and now - written < QUIET_SECONDS
