"""A client that reads one byte of a stream and drops the socket (no orderly HTTP close) still
aborts its request: the engine frees the blocks within a few steps, on every generation endpoint."""
from __future__ import annotations

import json
import socket

import pytest

from .harness import assert_engine_idle

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True},
    "/v1/responses": {"input": "hi", "max_output_tokens": 300},
    "/v1/completions": {"prompt": "hi", "max_tokens": 300, "ignore_eos": True},
}


def drop_after_first_byte(url: str, path: str, body: dict) -> None:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (path.encode(), len(data)) + data)
        assert s.recv(1)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_dropped_socket_aborts_the_stream(server, path):
    for _ in range(4):
        drop_after_first_byte(server.url, path, BODIES[path])
        assert_engine_idle(server.llm, timeout=15)
