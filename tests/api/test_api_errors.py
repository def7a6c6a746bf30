"""Bad input, unsupported fields, auth, overload and drain: OpenAI error bodies with the right status,
and after each one the engine still serves the next request with every KV block back in the pool."""
from __future__ import annotations

import concurrent.futures
import gzip
import json
import socket
import urllib.parse

import pytest

from .harness import Http, assert_engine_idle, assert_error, serve_app

CHAT = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "hello " * 600  # over max_model_len=512 of the test engine


@pytest.fixture(scope="module")
def server(loop_thread, engine):
    with serve_app(loop_thread, engine, max_request_bytes=64 << 10) as served:
        yield served


@pytest.fixture(scope="module")
def http(server):
    with Http(server.url) as client:
        yield client


def still_serves(http, server):
    """The next good request succeeds, and nothing leaked."""
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert_engine_idle(server.llm)


def chat(**fields):
    return ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **fields})


def completion(**fields):
    return ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, **fields})


BAD_REQUESTS = {
    # name: ((path, body), status, param, code)
    "temperature below 0": (chat(temperature=-0.5), 400, "temperature", None),
    "temperature of wrong type": (chat(temperature="hot"), 400, "temperature", None),
    "top_p above 1": (chat(top_p=1.5), 400, "top_p", None),
    "top_p below 0": (completion(top_p=-0.1), 400, "top_p", None),
    "n below 1": (chat(n=0), 400, "n", None),
    "n not an integer": (completion(n=1.5), 400, "n", None),
    "max_tokens below 1": (completion(max_tokens=0), 400, "max_tokens", None),
    "max_completion_tokens below 1": (chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
    "max_tokens as a string": (chat(max_tokens="5"), 400, "max_tokens", None),
    "presence_penalty out of range": (chat(presence_penalty=3), 400, "presence_penalty", None),
    "stream not a boolean": (chat(stream="yes"), 400, "stream", None),
    "stop not strings": (completion(stop=[1, 2]), 400, "stop", None),
    "messages missing": (("/v1/chat/completions", {"max_tokens": 2}), 400, "messages", "missing_required_parameter"),
    "messages empty": (chat(messages=[]), 400, "messages", None),
    "unknown role": (chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    "image content part": (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]), 400, "messages[0].content[0].type", None),
    "prompt missing": (("/v1/completions", {"max_tokens": 2}), 400, "prompt", None),
    "prompt empty": (completion(prompt=""), 400, "prompt", None),
    "prompt of mixed types": (completion(prompt=["a", 1]), 400, "prompt", None),
    "token id outside the vocabulary": (completion(prompt=[1, 10**9]), 400, "prompt", None),
    "prompt longer than the context": (completion(prompt=LONG_PROMPT), 400, "prompt", "context_length_exceeded"),
    "chat longer than the context": (chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400, "messages",
                                     "context_length_exceeded"),
    "max_tokens beyond the context": (completion(max_tokens=600), 400, "max_tokens", "context_length_exceeded"),
    "unknown model": (chat(model="gpt-17"), 404, "model", "model_not_found"),
    "tool without a function": (chat(tools=[{"type": "function"}]), 400, "tools[0].function",
                                "missing_required_parameter"),
    "tool_choice required": (chat(tool_choice="required"), 400, "tool_choice", None),
    "json_schema format without a schema": (chat(response_format={"type": "json_schema"}), 400,
                                            "response_format.json_schema", None),
    "logit_bias outside the vocabulary": (completion(logit_bias={"50256": -100}), 400, "logit_bias", "any"),
    "best_of above n": (completion(best_of=3), 400, "best_of", None),
    "echo not a boolean": (completion(echo="yes"), 400, "echo", None),
    "suffix": (completion(suffix="!"), 400, "suffix", None),
    "top_logprobs without logprobs": (chat(top_logprobs=2), 400, "top_logprobs", None),
    "too many logprobs": (completion(logprobs=50), 400, "logprobs", None),
    "temperature above 2, as OpenAI refuses it": (chat(temperature=2.5), 400, "temperature", None),
    "max_tokens 0 without echo": (completion(max_tokens=0), 400, "max_tokens", None),
    "unknown field": (chat(frobnicate=1), 400, "frobnicate", "unknown_parameter"),
    "unknown stream option": (completion(stream=True, stream_options={"include_everything": True}), 400,
                              "stream_options.include_everything", "unknown_parameter"),
    "audio output": (chat(modalities=["text", "audio"]), 400, "modalities", None),
    "lone surrogate in a prompt": (completion(prompt="a\ud800b"), 400, "any", "any"),
    "lone surrogate in a message": (chat(messages=[{"role": "user", "content": "\udfff"}]), 400, "any", "any"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_request_gets_an_openai_error_and_the_engine_keeps_serving(case, http, server):
    (path, body), status, param, code = BAD_REQUESTS[case]
    assert_error(http.post(path, json=body), status, param=param, code=code)
    still_serves(http, server)


@pytest.mark.parametrize("case", ["temperature below 0", "prompt longer than the context", "unknown model",
                                  "max_tokens beyond the context"])
def test_streaming_request_that_fails_gets_the_status_before_any_stream(case, http, server):
    (path, body), status, param, code = BAD_REQUESTS[case]
    r = http.post(path, json={**body, "stream": True}, stream=True)
    assert_error(r, status, param=param, code=code)
    still_serves(http, server)


def test_invalid_json_is_a_400(http, server):
    r = http.post("/v1/chat/completions", data=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert "JSON" in assert_error(r, 400)["message"]
    assert_error(http.post("/v1/completions", json=[1, 2]), 400)
    nested = b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"
    assert "JSON" in assert_error(http.post("/v1/completions", data=nested,
                                            headers={"Content-Type": "application/json"}), 400)["message"]
    still_serves(http, server)


def test_body_over_the_size_limit_is_a_413(http, server):
    r = http.post("/v1/completions", json={"prompt": "x" * (100 << 10), "max_tokens": 1})
    assert_error(r, 413, code="request_too_large")
    still_serves(http, server)


def raw_post(server, headers: bytes, body: bytes = b"") -> socket.socket:
    """A connection that has sent POST /v1/completions with ``headers`` (CRLF-ended lines) and
    ``body`` as they are, so a test can declare what it does not send; 10 s read timeout."""
    host, port = urllib.parse.urlsplit(server.url).netloc.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + headers + b"\r\n" + body)
    return sock


def json_reply(sock: socket.socket) -> tuple[bytes, dict]:
    """The status line and headers of the reply on ``sock``, and its JSON error; a
    ``socket.timeout`` (a failure) if the server waits for more of the request instead."""
    reply = b""
    while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"{" in body, reply[:300]
    return head, json.loads(body[body.index(b"{"):])["error"]


def test_a_declared_body_over_the_limit_is_a_413_before_the_body_is_read(http, server):
    """A Content-Length past the limit is refused at once: read first, a client declaring 1 TB and
    sending 2 bytes would hold the connection open until it gave up."""
    with raw_post(server, b"Content-Length: 999999999999\r\n", b"{}") as sock:
        head, error = json_reply(sock)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert error["code"] == "request_too_large" and "Content-Length 999999999999 exceeds" in error["message"]
    still_serves(http, server)


@pytest.mark.parametrize("length, first", [(999_999_999_999, b"HTTP/1.1 413"), (2, b"HTTP/1.1 100 Continue")])
def test_expect_100_continue_is_answered_only_within_the_limit(http, server, length, first):
    """A client that asks before uploading is told 413 at once, not asked for the body first."""
    with raw_post(server, b"Expect: 100-continue\r\nContent-Length: %d\r\n" % length) as sock:
        reply = sock.recv(65536)
    assert reply.startswith(first), reply[:300]
    still_serves(http, server)


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_a_body_its_content_encoding_does_not_decode_is_a_400(http, server, encoding):
    """aiohttp finds it only when the handler reads the body: a 400 in OpenAI's shape naming the
    encoding, not a 500 and two tracebacks."""
    body = b'{"prompt": "hi", "max_tokens": 1}'
    with raw_post(server, b"Content-Encoding: %s\r\nContent-Length: %d\r\n" % (encoding, len(body)), body) as sock:
        head, error = json_reply(sock)
    assert head.startswith(b"HTTP/1.1 400"), head
    assert b"\r\nConnection: close" in head  # aiohttp drops the connection after it: the client is told
    assert error["code"] == "invalid_request_body"
    assert error["message"] == f"The request body could not be read: Can not decode content-encoding: {encoding.decode()}."
    still_serves(http, server)


@pytest.mark.parametrize("encoding", [b"compress", b"gzip, gzip", b"gzip\r\nContent-Encoding: gzip",
                                      b"gzip, identity", b"x-gzip"])
def test_a_content_encoding_not_decoded_here_is_a_415_naming_those_that_are(http, server, encoding):
    """aiohttp passes such a body on undecoded (two stacked codings, in one header line or two,
    decoded once at most): the JSON parser got compressed bytes. RFC 9110 §15.5.16: 415 and the
    codings accepted."""
    body = gzip.compress(gzip.compress(b'{"prompt": "hi", "max_tokens": 1}'))
    with raw_post(server, b"Content-Encoding: %s\r\nContent-Length: %d\r\n" % (encoding, len(body)), body) as sock:
        head, error = json_reply(sock)
    assert head.startswith(b"HTTP/1.1 415"), head
    assert b"\r\nAccept-Encoding: gzip, deflate" in head
    assert error["code"] == "unsupported_content_encoding" and error["type"] == "invalid_request_error"
    named = encoding.decode().replace("\r\nContent-Encoding: ", ", ")
    assert error["message"].startswith(f"Content-Encoding '{named}' is not accepted")
    still_serves(http, server)


def test_a_path_no_route_takes_keeps_its_404_or_405_whatever_the_coding(http, server):
    headers = {"Content-Encoding": "compress", "Content-Type": "application/json"}
    assert_error(http.post("/nope", data=b"{}", headers=headers), 404)
    assert_error(http.post("/health", data=b"{}", headers=headers), 405)


@pytest.mark.parametrize("encoding", [b"identity", b"GZIP"])
def test_identity_and_a_decoded_coding_in_any_case_are_served(http, server, encoding):
    body = b'{"prompt": "hi", "max_tokens": 1}'
    if encoding != b"identity":
        body = gzip.compress(body)
    with raw_post(server, b"Content-Encoding: %s\r\nContent-Length: %d\r\n" % (encoding, len(body)), body) as sock:
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]


def test_unknown_path_and_wrong_method_are_json(http, server):
    message = assert_error(http.get("/v1/nothing-here"), 404, code="not_found")["message"]
    served = {f"{r.method} {r.resource.canonical}" for r in server.app.router.routes() if r.method != "HEAD"}
    assert {"POST /v1/responses", "GET /v1/responses/{response_id}", "POST /tokenize", "GET /v1/kv_events"} <= served
    assert all(route in message for route in served), message
    assert_error(http.post("/health"), 405, code="method_not_allowed")
    r = http.get("/v1/chat/completions")
    assert_error(r, 405, code="method_not_allowed")
    assert "POST" in r.headers["Allow"]


@pytest.mark.slow
def test_more_than_max_waiting_queued_requests_get_429_at_once(loop_thread, engine):
    # The test engine runs 8 at once; with --max-waiting 2, at most 10 of 16 are admitted.
    with serve_app(loop_thread, engine, max_waiting=2) as served:
        body = {"prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            responses = list(pool.map(lambda _: Http(served.url).post("/v1/completions", json=body), range(16)))
        rejected = [r for r in responses if r.status_code == 429]
        assert len(rejected) >= 6, [r.status_code for r in responses]
        assert all(r.status_code == 200 for r in responses if r not in rejected)
        for r in rejected:
            assert_error(r, 429, code="rate_limit_exceeded")
            assert r.headers["Retry-After"] == "1"
            assert r.elapsed.total_seconds() < 5  # refused at once, not after queueing
        assert_engine_idle(engine)


def test_one_call_with_many_sequences_fills_free_slots_first_and_too_many_is_a_400(loop_thread, engine):
    # Idle test engine: 8 slots; with --max-waiting 2 a call of 10 prompts runs 8 and queues 2.
    with serve_app(loop_thread, engine, max_waiting=2) as served:
        http = Http(served.url)
        ok = http.post("/v1/completions", json={"prompt": ["Hi"] * 10, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 10
        too_many = http.post("/v1/completions", json={"prompt": ["Hi"] * 11, "max_tokens": 2})
        assert_error(too_many, 400, code="too_many_sequences", param="prompt")
        assert "Split it" in too_many.json()["error"]["message"]
        ok = http.post("/v1/completions", json={"prompt": ["Hi"] * 2, "n": 5, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 10
        choices = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "n": 11, "max_tokens": 2})
        assert_error(choices, 400, code="too_many_sequences", param="n")
        assert "11 sequences" in choices.json()["error"]["message"]
        assert_engine_idle(engine)


def test_api_key_guards_v1_but_not_probes_or_metrics(loop_thread, engine):
    with serve_app(loop_thread, engine, api_key="s3cret") as served:
        url = served.url
        assert_error(Http(url).get("/v1/models"), 401, code="invalid_api_key")
        assert_error(Http(url).get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(Http(url).post("/v1/completions", json={"prompt": "x"}), 401)
        ok = Http(url).get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        for path in ("/health", "/ready", "/metrics"):
            assert Http(url).get(path).status_code == 200, path


def test_draining_server_is_unready_and_refuses_new_requests(loop_thread, engine):
    with serve_app(loop_thread, engine) as served:
        assert Http(served.url).get("/ready").status_code == 200
        served.state.draining = True
        assert Http(served.url).get("/ready").status_code == 503
        assert Http(served.url).get("/health").status_code == 200
        r = Http(served.url).post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert_error(r, 503, code="server_shutting_down")
        assert_engine_idle(engine)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("seed", 2**70), ("stop_token_ids", [-1]), ("stop_token_ids", [2**40]),
    ("logit_bias", {"²": 5}), ("logit_bias", {"٣": 5}), ("logit_bias", {"--5": 1}),
])
def test_values_that_would_overflow_the_sampler_are_400s_and_spare_the_batch(http, server, field, value):
    """One client's giant number must not fail the step that other requests share."""
    error = assert_error(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, field: value}), 400)
    assert error["param"].startswith(field), error  # stop_token_ids[0] names the element
    still_serves(http, server)
