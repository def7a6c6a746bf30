"""Fixtures for the tests on the real control plane (e2e/cluster): one cluster per session.

Without the binaries of ``make cluster`` (or without root) these tests skip, except under
``make test``, which builds the binaries and sets SLIPSTREAM_REQUIRE_CLUSTER=1 so that a
missing piece fails instead of passing silently.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from cluster_helpers import Cluster
from cluster import why_not_runnable


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the process kubelet
    (node ``node-1``, no GPUs), all on this machine; torn down at the end of the session."""
    reason = why_not_runnable()
    if reason:
        if os.environ.get("SLIPSTREAM_REQUIRE_CLUSTER"):
            pytest.fail(f"the cluster tests cannot run: {reason}")
        pytest.skip(reason)
    c = Cluster(gpus=0)
    try:
        c.start()
    except RuntimeError as err:
        c.stop()
        pytest.fail(f"the test cluster did not start: {err}")
    yield c
    c.stop()


