"""The ``pods`` fixture (every pod of :data:`gateway_helpers.PODS`, started once per session) and
the built-in ``tokenizer``."""
from __future__ import annotations

import pytest

from gateway_helpers import PODS, Pod, start_pods


@pytest.fixture(scope="session")
def pods() -> dict[str, Pod]:
    """Every pod of :data:`PODS`, ready (started together: each loads torch for a few seconds)."""
    started = start_pods(PODS)
    try:
        yield started
    finally:
        for pod in started.values():  # nothing to drain: a kill is quicker
            pod.kill()


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in model's tokenizer (what sim pods serve)."""
    from slipstream.server.models.loader import load_tokenizer

    return load_tokenizer("builtin")
