"""The autoscaler's tick (issue 6): list the pods, scrape the ready ones, decide, write.

For each InferenceService with ``spec.autoscaling.enabled``, every ``interval`` seconds (2 by
default) a kopf timer calls :meth:`Autoscaler.tick`:

1. list its pods by the Deployment's selector (with ``parallelism.pipeline`` > 1, the
   LeaderWorkerSet's group leaders, one per replica): ready pods with an IP are scraped, the others
   count as starting (:func:`scraper.pod_targets`); and, while ``spec.routing.enabled``, its
   gateway pods (``gateway_selector``, port 8000); with no pod to read the tick ends here;
2. read every ready pod's ``/metrics`` at once, each within ``scrape_timeout`` seconds
   (:func:`scraper.scrape_pods`; the gateway pods' waiting and in-flight requests with
   :func:`scraper.scrape_gateways`, the demand signal at zero replicas); a pod that does not
   answer is left out and counted;
3. :func:`policy.decide` (``spec.autoscaling.policy``: ``capacity`` by default, or ``queue``)
   with the fleet (ready pods, starting pods' ages, measured starts: :func:`fleet.fleet_from_pods`)
   and the state kept for this InferenceService (in memory; after an operator restart or a
   leader change, the copy mirrored in ``status.autoscaler``, whose learned capacity and start
   time are then the prior);
4. another scaler? (:mod:`foreign`): while a HorizontalPodAutoscaler or KEDA ScaledObject
   targets the Deployment (or LeaderWorkerSet), the autoscaler writes no replicas:
   ``ScalingActive=False``, reason ``ForeignScaler``, one Warning Event; it takes over again,
   with one Normal ``ScalingResumed`` Event, on the first tick after that object is deleted.
   A one-off write by another field manager (``kubectl scale deployment``) gets one Warning
   ``ReplicasOverridden`` Event and a note in the condition's message; the autoscaler keeps
   control and sets its own count on the same tick;
5. :func:`scaling.apply_scale`: the Deployment's (or LeaderWorkerSet's) ``spec.replicas``, a ``Scaled`` Event with the
   reason when the count changes, and the status (desiredReplicas, queueDepth,
   kvCacheUtilization, lastScaleTime, ScalingActive, autoscaler, scalingHistory,
   scrapeFailures, objectiveAttainment, lastDecision), written only when worth it
   (:func:`scaling.status_write_due`).

Scale to zero (``minReplicas: 0``) needs the gateway: it holds the requests that arrive at zero
replicas and its ``/metrics`` says they wait. Without it (``spec.routing.enabled: false``) the
tick keeps at least one replica and says so in the ``ScalingActive`` message.

With autoscaling off the timer does not run (its ``when`` filter), so replicas follow
``spec.replicas`` and the scale subresource. The policy's clock is wall-clock epoch seconds, so
the mirrored state means the same to whichever operator replica reads it next.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import aiohttp
import kopf

from slipstream.operator import status as st
from slipstream.api_types.load import GatewayLoad
from slipstream.operator.autoscaler import Decision, append_scaling_history
from slipstream.operator.fleet import fleet_from_pods
from slipstream.operator.policy import State, Tick, decide, load_state, prior_from_state
from slipstream.operator.capacity_policy import CapacityPrior
from slipstream.operator.model_spec import model_location
from slipstream.server.sim.options import parse_sim_model
from slipstream.server.sim.scalers import profile_prior
from slipstream.operator.events import post_event
from slipstream.operator.foreign import ReplicasWriter, ScalerObject, find_scalers, \
    foreign_writer
from slipstream.operator.gateway_resources import GATEWAY_PORT, gateway_selector
from slipstream.operator.group_resources import workload_resource
from slipstream.operator.kube import PODS, ApiError, Kube
from slipstream.operator.resources import GROUP, PLURAL, VERSION, gateway_selector_labels, \
    serving_pod_selector, serving_selector_labels
from slipstream.operator.scaling import MEMORY_SECONDS, apply_scale, status_write_due
from slipstream.operator.scraper import DEFAULT_TIMEOUT, GatewayScrape, ScrapeResult, pod_targets, \
    scrape_gateways, scrape_pods
from slipstream.operator.spec import InferenceServiceSpec, SpecError, parse_spec

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = 2.0
SCALED_TO_ZERO = "ScaledToZero"  # ScalingActive's reason while the autoscaler keeps 0 replicas
# How long a hand override's note stays in ScalingActive's message (and a repeat of the same
# override is not warned about again), seconds.
OVERRIDE_NOTE_SECONDS = 60.0
NO_GATEWAY_NOTE = ("; minReplicas 0 needs spec.routing.enabled (the gateway holds requests at zero "
                   "replicas and reports them), so at least 1 replica is kept")


@dataclass(frozen=True, slots=True)
class TickResult:
    """One tick of one InferenceService: the policy's decision, the pods it saw, what was written
    (``replicas`` None when apply_scale found nothing to scale). gateway: what the gateway pods
    reported (None: routing off, no gateway pod ready, or none answered)."""

    decision: Decision
    ready: int
    starting: int
    failures: tuple[str, ...]
    replicas: int | None
    foreign: ScalerObject | None = None
    gateway: GatewayLoad | None = None


def autoscaling_enabled(spec: Mapping[str, Any], **_: Any) -> bool:
    """kopf ``when`` filter: the timer runs only for objects with autoscaling on."""
    autoscaling = spec.get("autoscaling") if isinstance(spec, Mapping) else None
    return isinstance(autoscaling, Mapping) and autoscaling.get("enabled") is True


def condition(scrape: ScrapeResult, ready: int, starting: int, decision: Decision,
              gateway: GatewayScrape | None = None) -> tuple[bool, str, str]:
    """(active, reason, message) of ``ScalingActive`` after a tick (pure), another scaler aside
    (:func:`foreign_condition`). gateway: the gateway pods' scrape (None: routing off).

    Reasons: ``MetricsAvailable`` (pods, or with none ready the gateway, answered),
    ``ScaledToZero`` (the same, with 0 replicas wanted), ``MetricsUnavailable`` (no ready pod
    answered), ``GatewayUnavailable`` (0 replicas and no gateway pod answered, so a request
    waiting cannot be seen), ``NoReadyPods``.
    """
    failed = "; ".join(f"{f.pod}: {f.error}" for f in scrape.failures)
    gateway_failed = "; ".join(f"{f.pod}: {f.error}" for f in gateway.failures) if gateway else ""
    gateway_note = f"; gateway pods did not answer ({gateway_failed})" if gateway_failed else ""
    answered = "MetricsAvailable" if decision.desired_replicas else SCALED_TO_ZERO
    if scrape.samples:
        note = f"; {len(scrape.failures)} of {ready} ready pods did not answer ({failed})" if failed else ""
        return True, answered, decision.reason + note + gateway_note
    if ready:
        return False, "MetricsUnavailable", (f"none of {ready} ready pods answered /metrics ({failed}); "
                                             f"{decision.reason}{gateway_note}")
    if gateway is not None and gateway.sample is not None:
        return True, answered, decision.reason + gateway_note
    if gateway is not None and decision.current_replicas == 0:
        why = f"({gateway_failed})" if gateway_failed else "(none is ready)"
        return False, "GatewayUnavailable", (
            f"0 replicas and no gateway pod answered /metrics {why}, so requests waiting in the "
            f"gateway cannot be seen; {decision.reason}")
    return False, "NoReadyPods", f"no ready pod to read ({starting} starting); {decision.reason}{gateway_note}"


def foreign_condition(kind: str, name: str, scaler: ScalerObject, live: int, wanted: int,
                      ) -> tuple[bool, str, str]:
    """(active, reason, message) of ``ScalingActive`` while ``scaler`` scales workload
    ``kind``/``name`` (pure); the message holds no per-tick numbers but the counts."""
    return False, st.FOREIGN_SCALER, (
        f"{scaler.describe()} scales {kind} {name} (now {live} replicas; the autoscaler would "
        f"set {wanted}), so the autoscaler writes no replicas while it exists and takes over "
        f"again when it is deleted. Delete the {scaler.kind}, or set "
        f"spec.autoscaling.enabled to false to leave the replicas to it")


def override_note(kind: str, name: str, writer: ReplicasWriter, live: int, wanted: int) -> str:
    """The Warning Event's text, and the condition message's note, when ``writer`` set
    ``kind``/``name``'s replicas to ``live`` by hand while the autoscaler wants ``wanted``
    (pure)."""
    return (f"{writer.describe()} set spec.replicas of {kind} {name} to {live}; the autoscaler "
            f"keeps control while spec.autoscaling.enabled is true and sets {wanted}. Raise "
            f"the floor with spec.autoscaling.minReplicas, or set spec.autoscaling.enabled to "
            f"false to scale by hand")


Key = tuple[str, str]


def spec_prior(spec: InferenceServiceSpec) -> CapacityPrior:
    """The capacity policy's prior for ``spec`` (pure): for a simulated model (``sim:PROFILE``)
    the cost model's pod capacity (tokens/s, divided by its ``time_scale``), as ``slipstream
    simulate`` uses it; for real weights the generic default until a capacity is learned."""
    location = model_location(spec.model)
    if location.kind != "sim":
        return CapacityPrior()
    options = parse_sim_model(location.uri)
    prior = profile_prior(options.profile, spec.engine.max_num_seqs,
                          spec.engine.max_num_batched_tokens)
    return dataclasses.replace(prior, tokens_per_second=prior.tokens_per_second / options.time_scale,
                               drain_tokens_per_second=prior.drain_rate / options.time_scale)


def decision_status(decision: Decision) -> dict[str, Any]:
    """The status fields of the policy's numbers (pure): ``lastDecision`` (demand, capacity per
    pod, pods starting, desired, reason) and ``objectiveAttainment``, where the policy gives them."""
    fields: dict[str, Any] = {}
    if decision.details is not None:
        fields["lastDecision"] = dict(decision.details)
    if decision.attainment is not None:
        fields["objectiveAttainment"] = round(decision.attainment, 4)
    return fields


@dataclass
class Autoscaler:
    """The operator's autoscaling memory and its scrape session; one per operator process.

    scrape_timeout: seconds each pod has to answer. clock: the policy's clock (epoch seconds).
    memory_seconds: how often the policy's memory is persisted in the status when nothing else
    changed. gateway_port: where the gateway pods serve ``/metrics``.
    """

    scrape_timeout: float = DEFAULT_TIMEOUT
    clock: Callable[[], float] = time.time
    memory_seconds: float = MEMORY_SECONDS
    gateway_port: int = GATEWAY_PORT
    states: dict[Key, State] = field(default_factory=dict)
    histories: dict[Key, list[dict[str, Any]]] = field(default_factory=dict)
    written: dict[Key, int] = field(default_factory=dict)  # replicas this operator last set
    foreign: dict[Key, ScalerObject] = field(default_factory=dict)  # the scaler we stand back for
    # The last hand override warned about, (manager, count), and when (clock): the note stays
    # in the condition's message for OVERRIDE_NOTE_SECONDS.
    overridden: dict[Key, tuple[tuple[str, int], float, str]] = field(default_factory=dict)
    status_written: dict[Key, float] = field(default_factory=dict)  # clock of the last write
    _session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # limit=0: every pod at once (scraper's note); one session keeps connections to pods warm.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def forget(self, namespace: str, name: str) -> None:
        for memory in (self.states, self.histories, self.written, self.foreign,
                       self.overridden, self.status_written):
            memory.pop((namespace, name), None)

    def _write_due(self, key: Key) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
        def due(live: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
            now, last = self.clock(), self.status_written.get(key)
            if not status_write_due(live, new, None if last is None else now - last,
                                    memory_seconds=self.memory_seconds):
                return False
            self.status_written[key] = now
            return True
        return due

    def _other_scaler(self, key: Key, scalers: list[ScalerObject], status: Mapping[str, Any],
                      ) -> tuple[ScalerObject | None, str | None]:
        """(the scaler object to stand back for or None, the Event to post: "entered",
        "resumed" or None). Updates this object's memory of it."""
        previous = st.find_condition(status.get("conditions"), st.SCALING_ACTIVE) or {}
        # Standing back already: in this process, or (fresh after a restart: no memory of the
        # service yet; the status may lag this process's own writes) as the condition says.
        was_held = key in self.foreign or (
            key not in self.written and previous.get("reason") == st.FOREIGN_SCALER)
        if scalers:
            self.foreign[key] = scalers[0]
            return scalers[0], None if was_held else "entered"
        self.foreign.pop(key, None)
        return None, "resumed" if was_held else None

    def _override(self, key: Key, deployment: Mapping[str, Any], status: Mapping[str, Any],
                  scaling: Any, now: float) -> tuple[ReplicasWriter | None, bool, int | None]:
        """(the manager that set the replicas by hand, or None; whether it is a new override
        to warn about; the count the autoscaler last set)."""
        expected = self.written.get(key, status.get("desiredReplicas"))
        if expected is not None:  # the reconcile loop may have pulled it into new bounds
            expected = scaling.clamp(int(expected))
        writer = foreign_writer(deployment, expected)
        if writer is None:
            return None, False, expected
        live = int((deployment.get("spec") or {}).get("replicas", 1))
        seen = self.overridden.get(key)
        return writer, seen is None or seen[0] != (writer.manager, live) \
            or now - seen[1] >= OVERRIDE_NOTE_SECONDS, expected

    async def tick(self, kube: Kube, namespace: str, name: str, body: Mapping[str, Any]) -> TickResult | None:
        """One autoscaling tick for ``namespace/name`` (``body``: its latest known object).

        Returns None when there is nothing to scale: autoscaling off, an invalid spec (the
        reconcile loop reports it), no Deployment or no pod yet. Raises kube.ApiError.
        """
        key = (namespace, name)
        try:
            spec = parse_spec(body.get("spec"), name=name)
        except SpecError:
            return None
        policy = spec.autoscaling
        if not policy.enabled:
            self.forget(namespace, name)
            return None
        # A LeaderWorkerSet's replica is a group, whose leader alone serves and exports metrics.
        deployment = await kube.get(workload_resource(spec)[0], namespace, name)
        if deployment is None:
            return None
        current = int((deployment.get("spec") or {}).get("replicas", 1))
        pods = await self._pods(kube, namespace, serving_pod_selector(name, spec),
                                serving_selector_labels(name, spec))
        gateway_pods = await self._pods(kube, namespace, gateway_selector(name),
                                        gateway_selector_labels(name)) if spec.routing.enabled else []
        if not spec.routing.enabled and policy.min_replicas == 0:
            policy = policy.model_copy(update={"min_replicas": 1})  # nothing would hold or report requests at zero
        if not pods and (current > 0 or (not gateway_pods and policy.min_replicas == 0)):
            return None  # none created yet: nothing to read, and holding the count needs no write
        targets, starting = pod_targets(pods, spec.port)
        gateway_targets, _ = pod_targets(gateway_pods, self.gateway_port)
        scrape, gateway = await asyncio.gather(
            scrape_pods(targets, self.scrape_timeout, session=self.session(), clock=self.clock),
            scrape_gateways(gateway_targets, self.scrape_timeout, session=self.session(),
                            clock=self.clock))

        status = body.get("status") or {}
        state = self.states.get(key) or load_state(policy, status.get("autoscaler"))
        now = self.clock()
        fleet = fleet_from_pods(pods, now, [t.name for t in targets])
        resource, kind = workload_resource(spec)
        scalers = await find_scalers(kube, namespace, kind,
                                     f"{resource.group}/{resource.version}", name)
        writer, change = self._other_scaler(key, scalers, status)
        if change == "resumed":
            self.written[key] = current  # the other scaler's count is where we start again
        # Resuming from the other scaler's count is no override.
        override, new_override, expected = (None, False, None) if writer is not None or change \
            else self._override(key, deployment, status, policy, now)
        # A hand override does not move the policy: it decides from the count it set.
        decided_from = expected if override is not None and expected is not None else current
        decision = decide(policy, state, Tick(now, decided_from, fleet, scrape.samples,
                                              gateway.sample),
                          prior_from_state(state, spec_prior(spec)))
        self.states[key] = decision.state
        if change == "entered":
            await post_event(kube, body, "Warning", st.FOREIGN_SCALER, foreign_condition(
                kind, name, writer, current, decision.desired_replicas)[2])
        elif change == "resumed":
            await post_event(kube, body, "Normal", "ScalingResumed",
                             f"no HorizontalPodAutoscaler or ScaledObject scales {kind} {name} "
                             f"any more: the autoscaler writes replicas again, from {current}")
        if new_override:
            note = override_note(kind, name, override, current, policy.clamp(
                decision.desired_replicas))
            self.overridden[key] = ((override.manager, current), now, note)
            await post_event(kube, body, "Warning", st.REPLICAS_OVERRIDDEN, note)
        history = self.histories.get(key, status.get("scalingHistory") or [])
        if decision.scaled and writer is None:
            history = append_scaling_history(history, decision, st.timestamp(_utcnow()))
        self.histories[key] = history
        if writer is not None:
            active, reason, message = foreign_condition(kind, name, writer, current,
                                                        decision.desired_replicas)
        else:
            active, reason, message = condition(scrape, len(targets), starting, decision,
                                                gateway if spec.routing.enabled else None)
            if policy is not spec.autoscaling:
                message += NO_GATEWAY_NOTE
            recent = self.overridden.get(key)
            if recent is not None and now - recent[1] < OVERRIDE_NOTE_SECONDS:
                message += f"; {recent[2]}"
        written = await apply_scale(
            kube, namespace, name, replicas=decision.desired_replicas, queue_depth=decision.queue_depth,
            kv_cache_utilization=decision.kv_cache_utilization, active=active, reason=reason,
            message=message, extra_status={"autoscaler": decision.state.to_dict(), "scalingHistory": history,
                                           "scrapeFailures": len(scrape.failures),
                                           **decision_status(decision)},
            hold=writer is not None, write_due=None if new_override else self._write_due(key))
        if writer is None and written is not None:
            self.written[key] = written
        return TickResult(decision, len(targets), starting, tuple(scrape.failed_pods), written, writer,
                          gateway.sample)

    @staticmethod
    async def _pods(kube: Kube, namespace: str, selector: str, wanted: Mapping[str, str],
                    ) -> list[dict[str, Any]]:
        """The pods ``selector`` lists, checked against ``wanted`` labels as well (a server that
        ignored the selector must not hand the gateway's pods to the model's scrape)."""
        return [p for p in await kube.list(PODS, namespace, selector)
                if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v
                       for k, v in wanted.items())]


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def register(registry: kopf.OperatorRegistry, interval: float = DEFAULT_INTERVAL,
             scrape_timeout: float = DEFAULT_TIMEOUT) -> None:
    """Put the autoscaler's timer (every ``interval`` seconds, objects with autoscaling on) and
    its start-up and clean-up on ``registry``; it uses the operator's ``memo.kube``."""

    @kopf.on.startup(registry=registry)
    async def start_autoscaler(memo: Any, **_: Any) -> None:
        memo.autoscaler = Autoscaler(scrape_timeout=scrape_timeout)

    @kopf.on.cleanup(registry=registry)
    async def stop_autoscaler(memo: Any, **_: Any) -> None:
        autoscaler = getattr(memo, "autoscaler", None)
        if autoscaler is not None:
            await autoscaler.close()

    @kopf.timer(GROUP, VERSION, PLURAL, id="autoscale", interval=interval, sharp=True,
                when=autoscaling_enabled, registry=registry)
    async def autoscale(namespace: str, name: str, body: kopf.Body, memo: Any, logger: kopf.Logger,
                        **_: Any) -> None:
        try:
            result = await memo.autoscaler.tick(memo.kube, namespace, name, body)
        except ApiError as exc:
            # The next tick reads everything again; kopf's backoff would only delay it.
            logger.warning(f"autoscaler tick failed, retrying next tick: {exc}")
            return
        if result is None:
            return
        log = logger.info if result.decision.scaled else logger.debug
        log(f"autoscaler: {result.decision.reason} (ready {result.ready}, starting {result.starting}, "
            f"unanswered {len(result.failures)})")

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="autoscaler-forget", optional=True, registry=registry)
    async def forget(namespace: str, name: str, memo: Any, **_: Any) -> None:
        autoscaler = getattr(memo, "autoscaler", None)
        if autoscaler is not None:
            autoscaler.forget(namespace, name)
