"""A real ``slipstream serve`` process: ready only after loading, and SIGTERM drains it (Kubernetes rolls
pods this way): /ready turns 503, new requests get 503, in-flight streams complete, exit code 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from .harness import assert_error, wait_until

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slipstream.server", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--max-num-seqs", "4", "--kv-cache-memory-bytes", "32MiB", "--max-model-len", "256", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.statuses: list[tuple[int | None, int | None]] = []  # (health, ready) while starting

    def get(self, path: str) -> int | None:
        try:
            return requests.get(self.url + path, timeout=5).status_code
        except requests.ConnectionError:
            return None

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            self.statuses.append((self.get("/health"), self.get("/ready")))
            if self.statuses[-1][1] == 200:
                return
            time.sleep(0.05)
        raise AssertionError("server did not become ready")

    def log(self) -> str:
        return self.proc.stdout.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _stream(url: str, body: dict, result: dict, started: threading.Event) -> None:
    result.update(chunks=0, done=False, finish=None, error=None)
    with requests.post(url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120) as r:
        result["status"] = r.status_code
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                result["done"] = True
                break
            payload = json.loads(line[6:])
            if "error" in payload:
                result["error"] = payload["error"]
                continue
            choice = payload["choices"][0]
            if choice["text"]:
                result["chunks"] += 1
                started.set()
            result["finish"] = choice["finish_reason"] or result["finish"]


def _start_streams(url: str, count: int, max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    results, threads = [], []
    for i in range(count):
        result, started = {}, threading.Event()
        body = {"prompt": f"Story number {i}:", "max_tokens": max_tokens, "ignore_eos": True}
        thread = threading.Thread(target=_stream, args=(url, body, result, started))
        thread.start()
        assert started.wait(120), result
        results.append(result)
        threads.append(thread)
    return threads, results


def test_sigterm_drains_in_flight_streams_then_exits_0():
    server = ServeProcess("--shutdown-timeout", "120", "--log-interval", "0.5")
    try:
        server.wait_ready()
        # listening before the model is loaded: alive but not ready
        assert (200, 503) in server.statuses
        threads, results = _start_streams(server.url, 3, max_tokens=48)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: server.get("/ready") == 503, 5)
        assert server.get("/health") == 200
        refused = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        assert_error(refused, 503, code="server_shutting_down")
        for thread in threads:
            thread.join(120)
        for result in results:
            assert result["status"] == 200 and result["error"] is None
            assert result["finish"] == "length" and result["done"]
        assert server.proc.wait(60) == 0
        log = server.log()
        assert "draining" in log and "all requests finished" in log
        assert log.count("finish=length") == 3 and "output_tokens=48" in log
        assert "running=" in log and "generation_throughput=" in log  # the periodic status line
    finally:
        server.kill()


def test_drain_that_runs_out_of_time_aborts_with_503_and_exits_0():
    server = ServeProcess("--shutdown-timeout", "0.5", "--log-interval", "0")
    try:
        server.wait_ready()
        threads, results = _start_streams(server.url, 2, max_tokens=240)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        for result in results:
            assert result["error"] is not None and result["error"]["code"] == "server_shutting_down"
            assert result["done"] and result["finish"] is None
        assert server.proc.wait(60) == 0
        assert "aborted the rest" in server.log()
    finally:
        server.kill()


def test_sigterm_during_a_first_use_kernel_build_stops_the_compiler_and_exits_143(tmp_path):
    """An install without built CPU kernels compiles them on first start; a pod deleted meanwhile
    must not wait for the compiler (nor leave it running), as a model download does not."""
    (tmp_path / "sitecustomize.py").write_text(  # this install has no built kernels
        "from pathlib import Path\nfrom slipstream.kernels import cpu_build\n"
        f"cpu_build.PACKAGE_DIR = Path({str(tmp_path / 'none')!r})\n")
    cc = tmp_path / "hanging-cc"
    cc.write_text(f"#!/bin/sh\ncase \"$1\" in --version) echo hang 1; exit 0;; esac\n"
                  f"sleep 300 &\necho $! > {tmp_path}/child\nwait\n")
    cc.chmod(0o755)
    env = {"PYTHONPATH": str(tmp_path), "CC": str(cc), "SLIPSTREAM_CACHE_DIR": str(tmp_path / "cache")}
    server = ServeProcess.__new__(ServeProcess)
    server.port = _free_port()
    server.proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream.server", "serve", "--host", "127.0.0.1", "--port", str(server.port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **env})
    try:
        assert wait_until(lambda: (tmp_path / "child").exists(), timeout=120), server.proc.poll()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 143
        log = server.log()
        assert "compiling the generic CPU kernels" in log and "SIGTERM while loading the model" in log, log
        child = int((tmp_path / "child").read_text())
        assert wait_until(lambda: not os.path.exists(f"/proc/{child}/stat")
                          or open(f"/proc/{child}/stat").read().split()[2] == "Z", timeout=10), "the compiler lives on"
        assert not list((tmp_path / "cache" / "kernels").glob("*.failed")), "a stop is not a failed build"
    finally:
        server.kill()
