"""Other scalers of the same workload, and how the autoscaler tells them apart (issue 33).

Two kinds, handled differently:

* **A scaler object** (a HorizontalPodAutoscaler, ``autoscaling/v2``, or a KEDA ScaledObject,
  ``keda.sh/v1alpha1``) whose ``scaleTargetRef`` names the InferenceService's Deployment (or
  LeaderWorkerSet). While one exists the autoscaler writes no replicas; it takes over again
  when the object is deleted. Its existence is the signal, read from the API on every tick:
  no timer guesses when it has gone. A cluster that does not serve ScaledObjects (KEDA not
  installed) has none.
* **A one-off write by another field manager** (``kubectl scale deployment``, a script): the
  API server records the writer in ``metadata.managedFields``; every write of the operator
  names :data:`kube.FIELD_MANAGER`. The autoscaler keeps control (it sets its own count again
  on the same tick) and says so: one Warning Event per override and a note in the
  ``ScalingActive`` message. Scaling by hand is ``spec.autoscaling.enabled: false``; raising
  the floor is ``spec.autoscaling.minReplicas``.

The functions here are pure, but :func:`find_scalers`, which lists the scaler objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from slipstream.operator.kube import FIELD_MANAGER, HORIZONTAL_POD_AUTOSCALERS, SCALED_OBJECTS, \
    ApiError, Kube


@dataclass(frozen=True, slots=True)
class ScalerObject:
    """An object that scales a workload: ``kind`` (``HorizontalPodAutoscaler`` or
    ``ScaledObject``) and ``name``, in the workload's namespace."""

    kind: str
    name: str

    def describe(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True, slots=True)
class ReplicasWriter:
    """A field manager that owns a Deployment's ``spec.replicas``: ``manager`` (its name, e.g.
    ``kubectl``), ``subresource`` (``scale`` when it wrote through ``/scale``)."""

    manager: str
    subresource: str | None = None

    def describe(self) -> str:
        via = " through the scale subresource" if self.subresource == "scale" else ""
        return f"{self.manager}{via}"


def targets(ref: Mapping[str, Any] | None, kind: str, api_version: str, name: str) -> bool:
    """Whether a ``scaleTargetRef`` names the workload ``kind``/``name`` of API group
    ``api_version``'s group (any version). KEDA defaults ``kind`` to Deployment and
    ``apiVersion`` to apps/v1, so missing fields take those values."""
    if not isinstance(ref, Mapping) or ref.get("name") != name:
        return False
    group = str(ref.get("apiVersion") or "apps/v1").rpartition("/")[0]
    return (ref.get("kind") or "Deployment") == kind and group == api_version.rpartition("/")[0]


def scalers_of(hpas: Iterable[Mapping[str, Any]], scaled_objects: Iterable[Mapping[str, Any]],
               kind: str, api_version: str, name: str) -> list[ScalerObject]:
    """The HPAs and ScaledObjects (listed in the workload's namespace) that scale workload
    ``kind``/``name``, those being deleted left out, in list order."""
    found = []
    for scaler_kind, objects in (("HorizontalPodAutoscaler", hpas), ("ScaledObject", scaled_objects)):
        for obj in objects:
            meta = obj.get("metadata") or {}
            if not meta.get("deletionTimestamp") and targets(
                    (obj.get("spec") or {}).get("scaleTargetRef"), kind, api_version, name):
                found.append(ScalerObject(scaler_kind, meta.get("name", "")))
    return found


async def find_scalers(kube: Kube, namespace: str, kind: str, api_version: str, name: str,
                       ) -> list[ScalerObject]:
    """The scaler objects of workload ``namespace/name`` (see :func:`scalers_of`). A resource
    the server does not serve (404: KEDA not installed) has none. Raises kube.ApiError."""
    lists = []
    for resource in (HORIZONTAL_POD_AUTOSCALERS, SCALED_OBJECTS):
        try:
            lists.append(await kube.list(resource, namespace))
        except ApiError as exc:
            if exc.status != 404:
                raise
            lists.append([])
    return scalers_of(lists[0], lists[1], kind, api_version, name)


def replicas_writers(deployment: Mapping[str, Any]) -> list[ReplicasWriter]:
    """The managers that own ``spec.replicas`` of ``deployment`` (usually one), from its
    ``metadata.managedFields``."""
    found = []
    for entry in (deployment.get("metadata") or {}).get("managedFields") or ():
        fields = (entry.get("fieldsV1") or {}).get("f:spec") or {}
        if "f:replicas" in fields:
            found.append(ReplicasWriter(entry.get("manager") or "an unnamed manager",
                                        entry.get("subresource") or None))
    return found


def foreign_writer(deployment: Mapping[str, Any], expected: int | None,
                   ours: str = FIELD_MANAGER) -> ReplicasWriter | None:
    """Who set ``deployment``'s ``spec.replicas`` behind the operator's back, or None.

    expected: the replica count the operator last set (None: not known, e.g. a fresh operator
    with no ``status.desiredReplicas``: nothing is foreign until it is). A manager that owns
    the field with our count (a ``kubectl scale`` to the same number) is no override.
    """
    live = (deployment.get("spec") or {}).get("replicas", 1)
    if expected is None or live == expected:
        return None
    meta = deployment.get("metadata") or {}
    if "managedFields" not in meta:
        return ReplicasWriter("an unknown writer")
    others = [w for w in replicas_writers(deployment) if w.manager != ours]
    return others[-1] if others else None
