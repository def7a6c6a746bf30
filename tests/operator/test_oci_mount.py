"""How an ``oci://`` model image is mounted: the pure rule, and the dry run that feeds it.

The real API server's answers (1.36, and 1.34 with the ImageVolume gate off and on) are in
tests/cluster/test_image_volume_probe.py; here the emulator, which answers a dry run without
storing it, as the API server does.
"""
from __future__ import annotations

import pytest

from kube_emulator import ApiServer
from slipstream.operator.kube import DEPLOYMENTS, Kube
from slipstream.operator.model_spec import ModelSpec, OCISpec, needs_mount_probe, resolve_oci_mount

IMAGE = "oci://registry.example/models/m:1"


@pytest.mark.parametrize("version, admitted, mount", [
    ((1, 34), True, "image-volume"),   # a 1.34 cluster with the beta gate turned on
    ((1, 35), False, "modelcar"),      # a 1.35 cluster with the gate turned off
    ((1, 36), None, "image-volume"),   # the dry run could not tell: by version
    ((1, 34), None, "modelcar"),
    (None, None, "image-volume"),      # nothing known: a current cluster
])
def test_auto_follows_the_api_servers_answer_and_else_the_version(version, admitted, mount):
    model = ModelSpec(uri=IMAGE, oci=OCISpec())
    assert needs_mount_probe(model)
    assert resolve_oci_mount(model, version, admitted).oci.mount == mount


@pytest.mark.parametrize("forced", ["image-volume", "modelcar"])
def test_a_forced_mount_and_other_models_are_left_alone(forced):
    model = ModelSpec(uri=IMAGE, oci=OCISpec(mount=forced))
    assert not needs_mount_probe(model)
    assert resolve_oci_mount(model, (1, 36), not (forced == "image-volume")) is model
    for other in (ModelSpec(), ModelSpec(uri="hf://org/name"), ModelSpec(uri="pvc://claim/path")):
        assert not needs_mount_probe(other) and resolve_oci_mount(other, (1, 36), False) is other


async def test_the_dry_run_is_asked_once_and_stores_nothing(api: ApiServer, kube: Kube, monkeypatch):
    asked, real = [], kube.request

    async def counting(method, path, *args, **kwargs):
        asked.append((method, path))
        return await real(method, path, *args, **kwargs)

    monkeypatch.setattr(kube, "request", counting)
    assert await kube.image_volumes_admitted("default") is True
    assert await kube.image_volumes_admitted("default") is True
    assert asked == [("POST", "/apis/apps/v1/namespaces/default/deployments?dryRun=All")]
    assert await kube.list(DEPLOYMENTS, "default") == []


async def test_a_refused_dry_run_leaves_the_choice_to_the_version():
    class Refusing(Kube):
        async def request(self, method, path, body=None, content_type="application/json"):
            from slipstream.operator.kube import ApiError
            raise ApiError(403, "Forbidden", "deployments.apps is forbidden")

    kube = Refusing("http://127.0.0.1:9")
    assert await kube.image_volumes_admitted("default") is None
