"""Fixtures for the operator tests: the CRD, an emulated API server, a running operator."""
from __future__ import annotations

from typing import Any, AsyncIterator

import kmock
import kopf
import pytest
import yaml

from kube_emulator import ApiServer
from operator_helpers import CRD_PATH, running_operator
from slipstream.operator.handlers import OperatorConfig, register
from slipstream.operator.kube import Kube


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


@pytest.fixture
async def api(crd: dict[str, Any]) -> AsyncIterator[ApiServer]:
    """An emulated API server on 127.0.0.1 with the InferenceService CRD applied."""
    async with ApiServer() as server, kmock.Server(server):
        server.add_crd(crd)
        yield server


@pytest.fixture
async def kube(api: ApiServer) -> AsyncIterator[Kube]:
    client = Kube(str(api.url))
    yield client
    await client.close()


@pytest.fixture
async def operator(api: ApiServer, request: pytest.FixtureRequest,
                   ) -> AsyncIterator[kopf.OperatorRegistry]:
    """The real operator (kopf) serving all namespaces of ``api``, with a 1-second resync so
    level-based repairs show quickly (``@pytest.mark.resync(seconds)`` sets another)."""
    registry = kopf.OperatorRegistry()
    url = str(api.url)
    marker = request.node.get_closest_marker("resync")
    register(registry, OperatorConfig(
        resync_seconds=marker.args[0] if marker else 1.0,
        login=lambda **_: kopf.ConnectionInfo(server=url, insecure=True),
        kube=lambda: Kube(url)))
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.networking.request_timeout = 10
    async with running_operator(registry=registry, settings=settings, clusterwide=True,
                                standalone=True):
        yield registry


def pytest_configure(config: pytest.Config) -> None:
    # kmock 0.8 loads its bundled resource list with a deprecated importlib call.
    config.addinivalue_line("filterwarnings",
                            "ignore:read_binary is deprecated:DeprecationWarning")
    config.addinivalue_line("markers", "resync(seconds): the operator fixture's resync period")
