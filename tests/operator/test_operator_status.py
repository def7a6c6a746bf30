"""Pure status and drift logic: conditions, replica counts, live-vs-rendered comparison, the
autoscaler's status patch."""
from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest

from slipstream.operator import status as st
from slipstream.operator.drift import contains, foreign_owner, plan_deployment, plan_service
from slipstream.operator.resources import render_deployment, render_service
from slipstream.operator.scaling import scale_status
from slipstream.operator.spec import parse_spec

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
T1 = T0 + datetime.timedelta(minutes=5)


def isvc(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "ml", "generation": 3}, "spec": spec}


def deployment(spec_replicas: int = 2, generation: int = 1, **status: Any) -> dict[str, Any]:
    return {"metadata": {"generation": generation}, "spec": {"replicas": spec_replicas},
            "status": {"observedGeneration": generation, **status}}


def as_the_server_keeps_it(obj: dict[str, Any]) -> dict[str, Any]:
    """What GET returns after create: server defaults added, quantities normalized."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="u", resourceVersion="7", generation=1,
                            creationTimestamp="2026-01-01T00:00:00Z")
    if live["kind"] == "Deployment":
        live["spec"].update(revisionHistoryLimit=10)
        pod = live["spec"]["template"]["spec"]
        pod.update(restartPolicy="Always", dnsPolicy="ClusterFirst", schedulerName="x")
        c = pod["containers"][0]
        c.update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/termination-log")
        c["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
        c["readinessProbe"]["successThreshold"] = 1
        c["resources"]["requests"]["cpu"] = "2000m"
        live["status"] = {"replicas": 1}
    else:
        live["spec"].update(clusterIP="10.0.0.1", sessionAffinity="None")
    return live


def test_condition_keeps_its_transition_time_until_its_status_changes():
    conds = st.set_condition(None, st.READY, "False", "NoReplicasReady", "0/1", T0)
    conds = st.set_condition(conds, st.READY, "False", "NoReplicasReady", "0/2", T1)
    assert conds[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert conds[0]["message"] == "0/2"
    conds = st.set_condition(conds, st.READY, "True", "ReplicasReady", "1/2", T1)
    assert conds[0]["lastTransitionTime"] == "2026-01-01T00:05:00Z"


def test_conditions_are_ordered_by_type():
    conds = st.set_condition(None, st.SCALING_ACTIVE, "False", "A", "", T0)
    conds = st.set_condition(conds, st.READY, "True", "B", "", T0)
    assert [c["type"] for c in conds] == [st.READY, st.SCALING_ACTIVE]


@pytest.mark.parametrize("dep, expected", [
    (None, ("False", "DeploymentMissing")),
    (deployment(spec_replicas=0), ("False", "ScaledToZero")),
    (deployment(readyReplicas=0), ("False", "NoReplicasReady")),
    (deployment(readyReplicas=1), ("True", "ReplicasReady")),
])
def test_ready_condition(dep, expected):
    assert st.ready_condition(dep)[:2] == expected


@pytest.mark.parametrize("dep, expected", [
    (None, ("True", "Creating")),
    (deployment(spec_replicas=2, updatedReplicas=1, availableReplicas=1),
     ("True", "RollingOut")),
    ({"metadata": {"generation": 2}, "spec": {"replicas": 2}, "status": {
        "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}},
     ("True", "RollingOut")),
    ({"metadata": {"generation": 1}, "spec": {"replicas": 2}, "status": {
        "observedGeneration": 1, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 2}},
     ("True", "RollingOut")),  # an old pod still terminating
    ({"metadata": {"generation": 1}, "spec": {"replicas": 2}, "status": {
        "observedGeneration": 1, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}},
     ("False", "RolloutComplete")),
    ({"metadata": {"generation": 1}, "spec": {"replicas": 2}, "status": {
        "conditions": [{"type": "Progressing", "status": "False",
                        "reason": "ProgressDeadlineExceeded", "message": "stuck"}]}},
     ("False", "ProgressDeadlineExceeded")),
])
def test_progressing_condition(dep, expected):
    assert st.progressing_condition(dep)[:2] == expected


def test_scaling_condition_keeps_the_autoscalers_verdict():
    on = parse_spec({"autoscaling": {"enabled": True}})
    assert st.scaling_condition(on, None)[1] == "AwaitingMetrics"
    mine = st.set_condition(None, st.SCALING_ACTIVE, "False", "MetricsUnavailable", "x", T0)
    assert st.scaling_condition(on, mine) == ("False", "MetricsUnavailable", "x")
    assert st.scaling_condition(parse_spec({}), mine)[1] == "AutoscalingDisabled"


def test_desired_replicas_follow_spec_or_the_autoscaler_within_bounds():
    off = parse_spec({"replicas": 3})
    on = parse_spec({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}})
    assert st.desired_replicas(off, {"desiredReplicas": 9}, None) == 3
    assert st.desired_replicas(on, {}, None) == 2
    assert st.desired_replicas(on, {}, deployment(spec_replicas=4)) == 4
    assert st.desired_replicas(on, {"desiredReplicas": 9}, deployment(spec_replicas=4)) == 5


def test_compute_status_reports_counts_url_generation_and_selector():
    body = isvc(replicas=2)
    status = st.compute_status(body, parse_spec(body["spec"]),
                               deployment(spec_replicas=2, replicas=2, readyReplicas=1),
                               url="http://chat.ml.svc.cluster.local", now=T0)
    assert {k: status[k] for k in ("replicas", "readyReplicas", "desiredReplicas", "url",
                                   "gateway", "observedGeneration", "selector")} == {
        "replicas": 2, "readyReplicas": 1, "desiredReplicas": 2,
        "url": "http://chat.ml.svc.cluster.local", "observedGeneration": 3,
        "gateway": {"url": "http://chat.ml.svc.cluster.local", "replicas": 0,
                    "readyReplicas": 0},
        "selector": "app.kubernetes.io/component=model-server,"
                    "slipstream.dev/inferenceservice=chat"}
    assert [c["type"] for c in status["conditions"]] == [st.READY, st.PROGRESSING,
                                                          st.SCALING_ACTIVE, st.GATEWAY_READY]
    assert set(status) == set(st.OWNED_FIELDS)


def test_failed_status_keeps_counts_and_says_why():
    body = isvc()
    body["status"] = {"replicas": 2, "conditions": st.set_condition(
        None, st.SCALING_ACTIVE, "True", "MetricsAvailable", "", T0)}
    status = st.failed_status(body, "InvalidSpec", "bad", T1)
    assert "replicas" not in status
    ready = st.find_condition(status["conditions"], st.READY)
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "InvalidSpec", "bad")
    assert st.find_condition(status["conditions"], st.SCALING_ACTIVE)["status"] == "True"


def test_contains_tolerates_server_defaults_and_normalized_quantities():
    desired = render_deployment(isvc())
    live = as_the_server_keeps_it(desired)
    assert contains(live, desired)
    assert not contains({"a": [1, 2]}, {"a": [1]})
    assert not contains({"a": {"b": 1}}, {"a": {"b": 2}})
    assert contains({}, {"annotations": {}})
    assert not contains({"resources": {"cpu": "1"}}, {"resources": {"cpu": "2"}})
    assert not contains({"port": "80"}, {"port": 80})  # a port name is not a number


def test_a_gpu_pods_dev_shm_size_limit_is_compared_as_a_quantity():
    spec = parse_spec({"resources": {"gpus": 1, "memory": "3Gi"}})
    desired = render_deployment(isvc(resources={"gpus": 1, "memory": "3Gi"}), spec)
    live = as_the_server_keeps_it(desired)
    [shm] = live["spec"]["template"]["spec"]["volumes"]
    shm["emptyDir"]["sizeLimit"] = "805306368"  # 768Mi, spelt otherwise
    assert plan_deployment(desired, live, spec) == (None, "")
    shm["emptyDir"]["sizeLimit"] = "1Gi"
    assert plan_deployment(desired, live, spec)[1] == \
        "restored fields that were changed outside the operator"


def test_plan_deployment_is_quiet_for_an_unchanged_live_object():
    spec = parse_spec({})
    desired = render_deployment(isvc(), spec)
    assert plan_deployment(desired, as_the_server_keeps_it(desired), spec) == (None, "")


def test_plan_deployment_restores_hand_edits_and_keeps_foreign_metadata():
    spec = parse_spec({})
    desired = render_deployment(isvc(), spec)
    live = as_the_server_keeps_it(desired)
    live["metadata"]["annotations"]["deployment.kubernetes.io/revision"] = "3"
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "other"
    new, why = plan_deployment(desired, live, spec)
    assert "outside the operator" in why
    assert new["spec"]["template"] == desired["spec"]["template"]
    assert new["metadata"]["resourceVersion"] == "7"  # a PUT that fails if the object moved
    assert new["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "3"
    assert new["spec"]["revisionHistoryLimit"] == 10
    assert "status" not in new


def test_plan_deployment_after_a_spec_change_says_whether_pods_roll():
    old_spec, new_spec = parse_spec({}), parse_spec({"engine": {"maxNumSeqs": 4}})
    live = as_the_server_keeps_it(render_deployment(isvc(), old_spec))
    _, why = plan_deployment(render_deployment(isvc(), new_spec), live, new_spec)
    assert why == "the InferenceService's spec changed; rolling the pods"
    scaled = parse_spec({"replicas": 4})
    new, why = plan_deployment(render_deployment(isvc(), scaled), live, scaled)
    assert (why, new["spec"]["replicas"]) == ("replicas 1 → 4", 4)


def test_plan_deployment_leaves_replicas_to_the_autoscaler_within_bounds():
    spec = parse_spec({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5}})
    desired = render_deployment(isvc(), spec)
    live = as_the_server_keeps_it(desired)
    live["spec"]["replicas"] = 4
    assert plan_deployment(desired, live, spec) == (None, "")
    tighter = parse_spec({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2}})
    new, _ = plan_deployment(render_deployment(isvc(), tighter), live, tighter)
    assert new["spec"]["replicas"] == 2
    # Another scaler owns the count (the autoscaler stood back): not even clamped.
    assert plan_deployment(render_deployment(isvc(), tighter), live, tighter,
                           hold_replicas=True) == (None, "")


def test_plan_service_keeps_the_cluster_ip():
    desired = render_service(isvc())
    live = as_the_server_keeps_it(desired)
    assert plan_service(desired, live) == (None, "")
    live["spec"]["ports"][0]["port"] = 8080
    new, _ = plan_service(desired, live)
    assert new["spec"]["ports"][0]["port"] == 80
    assert new["spec"]["clusterIP"] == "10.0.0.1"


def test_foreign_objects_are_recognized():
    ours = render_deployment(isvc())
    ours["metadata"]["ownerReferences"] = [{"uid": "u-1", "controller": True}]
    assert foreign_owner(ours, "u-1", "chat") is None
    assert "controlled by" in foreign_owner(ours, "u-2", "chat")
    assert "lacks the label" in foreign_owner({"metadata": {"labels": {}}}, "u-1", "chat")


def test_scale_status_records_metrics_condition_and_scale_time():
    new = scale_status({}, replicas=3, scaled=True, queue_depth=7.25,
                       kv_cache_utilization=0.456, active=True, reason="MetricsAvailable",
                       message="queue 7.25 > 5", now=T0, extra={"autoscaler": {"x": 1}})
    assert new["desiredReplicas"] == 3
    assert (new["queueDepth"], new["kvCacheUtilization"], new["kvCachePercent"]) == \
        (7.25, 0.456, 46)
    assert new["lastScaleTime"] == "2026-01-01T00:00:00Z"
    assert new["autoscaler"] == {"x": 1}
    assert st.find_condition(new["conditions"], st.SCALING_ACTIVE)["status"] == "True"
    quiet = scale_status({}, replicas=3, scaled=False, queue_depth=None,
                         kv_cache_utilization=None, active=False, reason="NoMetrics",
                         message="no ready pod answered", now=T0)
    assert "lastScaleTime" not in quiet and "queueDepth" not in quiet


def pod(name: str = "chat-1", waiting: dict[str, Any] | None = None,
        unschedulable: str | None = None, **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": name}, "status": {"phase": "Pending", **status}}
    if waiting:
        body["status"]["containerStatuses"] = [{"name": "server", "state": {"waiting": waiting}}]
    if unschedulable:
        body["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                         "reason": "Unschedulable", "message": unschedulable}]
    return body


GPU_SHORT = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


@pytest.mark.parametrize("pods,reason,words", [
    ([pod(unschedulable=GPU_SHORT)], "PodsPending", GPU_SHORT),
    ([pod(waiting={"reason": "ErrImagePull", "message": 'pull "x/y:1": not found'})],
     "ImagePullFailed", 'ErrImagePull: pull "x/y:1": not found'),
    ([pod(waiting={"reason": "ImagePullBackOff", "message": "Back-off pulling image"}),
      pod("chat-2", unschedulable=GPU_SHORT)], "ImagePullFailed", "chat-1: ImagePullBackOff"),
    ([pod(waiting={"reason": "CrashLoopBackOff", "message": "back-off 40s"}, phase="Running")],
     "CrashLoopBackOff", "keeps exiting"),
    ([pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "s" not found'})],
     "ContainerFailed", 'secret "s" not found'),
], ids=["unschedulable", "image-pull", "image-pull-first", "crash-loop", "config"])
def test_ready_says_why_no_pod_runs_in_the_kubelets_or_schedulers_words(pods, reason, words):
    status, got, message = st.ready_condition(deployment(1, readyReplicas=0), pods)
    assert (status, got) == ("False", reason) and words in message
    assert message.startswith("0/1 replicas ready; ")


def test_starting_and_terminating_pods_are_no_problem():
    starting = pod(waiting={"reason": "ContainerCreating"})
    leaving = pod("old", unschedulable=GPU_SHORT)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert st.pod_problem([starting, leaving]) is None
    assert st.ready_condition(deployment(1), [starting])[1] == "NoReplicasReady"
    ready, reason, message = st.ready_condition(deployment(2, readyReplicas=1),
                                                [pod(unschedulable=GPU_SHORT)])
    assert (ready, reason) == ("True", "ReplicasReady") and GPU_SHORT in message


# ---- the gateway (issue 12) -------------------------------------------------------------------

def test_with_routing_ready_needs_a_ready_gateway_too():
    spec = parse_spec({})
    model = deployment(spec_replicas=1, replicas=1, readyReplicas=1)
    assert st.service_ready(spec, model, gateway=None)[:2] == ("False", "GatewayMissing")
    ready, reason, message = st.service_ready(
        spec, model, gateway=deployment(spec_replicas=2, replicas=2, readyReplicas=0))
    assert (ready, reason) == ("False", "NoGatewayReplicasReady")
    assert message == "1/1 replicas ready, but 0/2 gateway replicas ready"
    ready, reason, message = st.service_ready(
        spec, model, gateway=deployment(spec_replicas=2, replicas=2, readyReplicas=1))
    assert (ready, reason) == ("True", "ReplicasReady")
    assert message == "1/1 replicas ready; 1/2 gateway replicas ready"


def test_scaled_to_zero_with_routing_is_ready_when_its_gateway_is():
    spec = parse_spec({"autoscaling": {"enabled": True, "minReplicas": 0}})
    zero = deployment(spec_replicas=0)
    assert st.service_ready(spec, zero, gateway=None)[:2] == ("False", "GatewayMissing")
    assert st.service_ready(spec, zero, gateway=deployment(spec_replicas=2, replicas=2))[:2] == \
        ("False", "NoGatewayReplicasReady")
    ready, reason, message = st.service_ready(
        spec, zero, gateway=deployment(spec_replicas=2, replicas=2, readyReplicas=2))
    assert (ready, reason) == ("True", "ScaledToZero")
    assert message == "the Deployment has 0 replicas; 2/2 gateway replicas ready: a request starts one"


def test_scaled_to_zero_by_hand_or_without_a_gateway_is_not_ready():
    gateway = deployment(spec_replicas=2, replicas=2, readyReplicas=2)
    for fields in ({"replicas": 0},  # nothing would start a pod on a request
                   {"autoscaling": {"enabled": True, "minReplicas": 0}, "routing": {"enabled": False}}):
        assert st.service_ready(parse_spec(fields), deployment(spec_replicas=0), gateway=gateway)[:2] == \
            ("False", "ScaledToZero"), fields


def test_model_pods_not_ready_say_so_before_the_gateway_does():
    spec = parse_spec({})
    assert st.service_ready(spec, deployment(spec_replicas=1, replicas=1), gateway=None)[1] == \
        "NoReplicasReady"


def test_without_routing_ready_ignores_the_gateway_and_gateway_ready_says_it_is_off():
    spec = parse_spec({"routing": {"enabled": False}})
    model = deployment(spec_replicas=1, replicas=1, readyReplicas=1)
    assert st.service_ready(spec, model, gateway=None)[0] == "True"
    assert st.gateway_condition(spec, None)[:2] == ("False", "RoutingDisabled")
    status = st.compute_status(isvc(routing={"enabled": False}), spec, model, url="u", now=T0)
    assert status["gateway"] is None  # a merge patch with null removes the field


def test_gateway_pods_that_cannot_start_say_why_in_gateway_ready():
    pods = [{"metadata": {"name": "chat-gateway-1"}, "status": {"containerStatuses": [{
        "name": "gateway", "state": {"waiting": {"reason": "ImagePullBackOff",
                                                 "message": "not found"}}}]}}]
    status, reason, message = st.gateway_condition(
        parse_spec({}), deployment(spec_replicas=2, replicas=2), pods)
    assert (status, reason) == ("False", "GatewayImagePullFailed")
    assert "chat-gateway-1: ImagePullBackOff: not found" in message


def test_gateway_status_reports_its_url_and_counts():
    body = isvc()
    status = st.compute_status(body, parse_spec({}), deployment(spec_replicas=1, readyReplicas=1),
                               url="http://chat.ml.svc.cluster.local", now=T0,
                               gateway=deployment(spec_replicas=2, replicas=2, readyReplicas=2))
    assert status["gateway"] == {"url": "http://chat.ml.svc.cluster.local", "replicas": 2,
                                 "readyReplicas": 2}
    assert st.find_condition(status["conditions"], st.GATEWAY_READY)["status"] == "True"
    assert st.find_condition(status["conditions"], st.READY)["status"] == "True"


def test_gateway_deployment_drift_is_put_back_and_a_routing_change_rolls_it():
    from slipstream.operator.drift import plan_gateway_deployment
    from slipstream.operator.gateway_resources import render_gateway_deployment, render_gateway_role
    desired = render_gateway_deployment(isvc())
    live = as_the_server_keeps_it(desired)
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "0.1"
    assert plan_gateway_deployment(desired, live) == (None, "")
    live["spec"]["replicas"] = 5
    new, why = plan_gateway_deployment(desired, live)
    assert new["spec"]["replicas"] == 2 and why == "gateway replicas 5 → 2"
    changed = render_gateway_deployment(isvc(routing={"policy": "prefix"}))
    new, why = plan_gateway_deployment(changed, as_the_server_keeps_it(desired))
    assert why == "the InferenceService's routing spec changed"
    assert "prefix" in new["spec"]["template"]["spec"]["containers"][0]["args"]
    # A Role's rules are ours too: a hand-widened Role is put back.
    role = render_gateway_role(isvc())
    widened = copy.deepcopy(role)
    widened["metadata"].update(resourceVersion="3")
    widened["rules"][0]["verbs"].append("delete")
    new, _ = plan_service(role, widened)
    assert new["rules"] == role["rules"] and new["metadata"]["resourceVersion"] == "3"
