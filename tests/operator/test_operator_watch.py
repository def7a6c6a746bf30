"""The operator's watch streams are bounded: a half-open watch (accepted, then silent, never
ended: a connection lost without a FIN) is dropped and replaced within the client timeout, so
the operator is never blind for long while its liveness probe stays green."""
from __future__ import annotations

import logging
import kopf
import pytest

from kube_emulator import ApiServer
from operator_helpers import NAMESPACE, eventually, running_operator
from slipstream.operator.handlers import OperatorConfig, WatchTimeouts, configure, register
from slipstream.operator.kube import DEPLOYMENTS, INFERENCESERVICES, Kube

pytestmark = pytest.mark.timeout(60)


def test_production_watches_end_and_time_out_well_under_a_minute():
    settings = kopf.OperatorSettings()
    configure(settings)
    watching = settings.watching
    assert watching.server_timeout == 30  # the API server ends each watch; kopf re-watches
    # kopf sends it as given: the real API server answers ?timeoutSeconds=30.0 with a 400.
    assert type(watching.server_timeout) is int
    assert watching.client_timeout == watching.inactivity_timeout == 40  # kopf's default: 70
    assert watching.server_timeout < watching.client_timeout  # a healthy stream ends server-side
    assert watching.connect_timeout == 10 and watching.reconnect_backoff == 1
    assert settings.posting.reporting_component == "slipstream-operator"
    assert settings.posting.level == logging.WARNING


async def test_a_half_open_watch_is_replaced_within_the_client_timeout(api, kube):
    api.stall_watches("inferenceservices")
    async with quick_operator_running(api):
        await eventually(lambda: "inferenceservices" in api.watches, what="the first watch")
        await kube.create(INFERENCESERVICES, {
            "apiVersion": "slipstream.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": NAMESPACE}, "spec": {}})
        # Blind on the stalled stream; seen once the client drops it (2 s) and watches again.
        await eventually(lambda: kube.get(DEPLOYMENTS, NAMESPACE, "chat"), timeout=8,
                         what="the Deployment, after the stalled watch was replaced")
        assert api.watches.count("inferenceservices") >= 2


async def test_the_emulator_ends_a_watch_after_its_timeout_seconds(api, kube):
    """As the API server does (`?timeoutSeconds=`): kopf then re-watches every 2 s here."""
    async with quick_operator_running(api):
        await eventually(lambda: api.watches.count("inferenceservices") >= 3, timeout=10,
                         what="three watches in a row")


def quick_operator_running(api: ApiServer):
    """The real operator with 2-second watch timeouts and no resync within a test."""
    registry = kopf.OperatorRegistry()
    url = str(api.url)
    register(registry, OperatorConfig(
        resync_seconds=600, login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
        kube=lambda: Kube(url), watch=WatchTimeouts(server=2, client=2, connect=1, backoff=0.1)))
    return running_operator(registry=registry, settings=kopf.OperatorSettings(),
                            clusterwide=True, standalone=True)
