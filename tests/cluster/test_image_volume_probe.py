"""The operator asks the real API server whether it admits image volumes (the ImageVolume
feature gate) instead of going by its version: this suite's 1.36 server (gate locked on) does;
a server emulating 1.34 (this release's kube-apiserver with ``--emulated-version=1.34``, on a
control plane of its own) does not by default although ``/version`` says 1.36, and does once
``--feature-gates=ImageVolume=true`` turns the beta gate on."""
from __future__ import annotations

import asyncio
import ssl

from cluster_helpers import REPO  # noqa: F401  (puts e2e/cluster on sys.path)
from controlplane import ControlPlane

from slipstream.operator.kube import Kube
from slipstream.operator.model_spec import ModelSpec, OCISpec, resolve_oci_mount


def admitted(plane: ControlPlane) -> tuple[bool | None, tuple[int, int] | None]:
    async def ask():
        kube = Kube(plane.server, token=plane.token,
                    ssl_context=ssl.create_default_context(cafile=str(plane.pki / "ca.crt")))
        try:
            return await kube.image_volumes_admitted("default"), await kube.server_version()
        finally:
            await kube.close()
    return asyncio.run(ask())


def test_the_api_servers_dry_run_decides_how_a_model_image_is_mounted(cluster, tmp_path):
    model = ModelSpec(uri="oci://registry.example/models/m:1", oci=OCISpec())
    said, version = admitted(cluster.plane)
    assert said is True and version >= (1, 36)
    assert resolve_oci_mount(model, version, said).oci.mount == "image-volume"

    plane = ControlPlane(build=tmp_path, run_dir=tmp_path / "run", apiserver_flags=["--emulated-version=1.34"])
    try:
        plane.start()
        said, version = admitted(plane)
        # /version gives the binary's 1.36, so the version rule alone would pick an image volume
        # this server drops; its dry run says no
        assert said is False and version >= (1, 36), (said, version)
        assert resolve_oci_mount(model, version, None).oci.mount == "image-volume"
        assert resolve_oci_mount(model, version, said).oci.mount == "modelcar"

        plane.components["kube-apiserver"].argv.append("--feature-gates=ImageVolume=true")
        plane.restart_apiserver()
        assert admitted(plane)[0] is True
    finally:
        plane.stop()
