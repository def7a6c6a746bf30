"""One real ``slipstream serve`` process of the built-in model on 127.0.0.1, shared by the client tests.

The clients talk to it exactly as their users would: base URL, API key, model name. Nothing leaves
loopback: hubs, cost maps and telemetry are switched off before any client is imported.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

# Read by the clients at import time: no hub, no remote cost map, no tracing or analytics.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_TRACING": "false",
    "DO_NOT_TRACK": "1",
    "GUIDELLM__LOGGING__DISABLED": "true",
}
os.environ.update(OFFLINE_ENV)

MODEL = "smollm2"  # --served-model-name: what every client passes as `model`
API_KEY = "sk-clients-test"


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    model: str
    api_key: str

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, as clients take it."""
        return self.url + "/v1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log_path: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"slipstream serve exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if requests.get(url + "/ready", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"slipstream serve not ready after {timeout} s:\n{open(log_path).read()}")


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """`slipstream serve` of the built-in model (CPU), with an API key, stopped after the session."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="slipstream-clients-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.server", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "2048",
         "--kv-cache-memory-bytes", "128MiB", "--max-num-seqs", "8", "--seed", "0"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV})
    try:
        _wait_ready(proc, url, log.name)
        yield Server(url=url, model=MODEL, api_key=API_KEY)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(log.name)
