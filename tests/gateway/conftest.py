"""The ``pods`` fixture (every pod of :data:`gateway_helpers.PODS`, started once per session) and
the built-in ``tokenizer``."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gateway_helpers import API_KEY, PODS, Pod, pod_ready
from loadgen import free_port


@pytest.fixture(scope="session")
def pods() -> dict[str, Pod]:
    """Every pod of :data:`PODS`, ready (started together: each loads torch for a few seconds)."""
    port = free_port(list(PODS.values()))
    logs = Path(tempfile.mkdtemp(prefix="slipstream-gateway-"))
    started: dict[str, Pod] = {}
    for name, address in PODS.items():
        log = logs / f"{name}.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "slipstream.server", "serve", "--model", "sim:tiny,time_scale=1",
             "--host", address, "--port", str(port), "--max-num-seqs", "8", "--log-interval", "0",
             "--shutdown-timeout", "1", "--api-key", API_KEY],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        started[name] = Pod(name, f"http://{address}:{port}", process, log)
    try:
        deadline = time.monotonic() + 90
        waiting = set(started)
        while waiting:
            for name in list(waiting):
                pod = started[name]
                if pod.process.poll() is not None:
                    raise RuntimeError(f"pod {name} exited: {pod.log.read_text()[-2000:]}")
                if pod_ready(pod.url):
                    waiting.discard(name)
            if time.monotonic() > deadline:
                raise RuntimeError(f"pods not ready after 90 s: {sorted(waiting)}")
            time.sleep(0.1)
        yield started
    finally:
        for pod in started.values():  # nothing to drain: a kill is quicker
            pod.kill()


@pytest.fixture(scope="session")
def tokenizer():
    """The built-in model's tokenizer (what sim pods serve)."""
    from slipstream.server.models.loader import load_tokenizer

    return load_tokenizer("builtin")
