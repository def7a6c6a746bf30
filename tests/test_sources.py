"""Model sources: URIs, fetching from a Hugging Face Hub (the loopback fixture of hub_server.py) and
from S3 (moto's server on loopback), the shared cache's lock, and `slipstream download`. Nothing
here leaves 127.0.0.1."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hub_server import HubServer, Repo
from slipstream.server.weights.cache import ModelCache
from slipstream.server.weights.eviction import evict
from slipstream.server.weights.errors import ModelSourceError
from slipstream.server.weights.fetch import fetch
from slipstream.server.weights.uri import parse_model_uri

TOKEN = "hf_good"


# --- URIs -------------------------------------------------------------------------------------

def test_uri_forms_parse_to_their_fields():
    assert parse_model_uri("builtin").scheme == "builtin"
    assert parse_model_uri("sim:h100,time_scale=0").profile == "h100,time_scale=0"
    u = parse_model_uri("hf://Org/Model-1.5B@v1.0:*Q4_K_M.gguf")
    assert (u.scheme, u.repo_id, u.revision, u.filename) == ("hf", "Org/Model-1.5B", "v1.0", "*Q4_K_M.gguf")
    assert parse_model_uri("hf://Org/M@refs/pr/3").revision == "refs/pr/3"
    bare = parse_model_uri("Org/Model")
    assert (bare.scheme, bare.repo_id, bare.revision, bare.filename) == ("hf", "Org/Model", "main", None)
    s3 = parse_model_uri("s3://my-bucket/models/llama/")
    assert (s3.scheme, s3.bucket, s3.prefix) == ("s3", "my-bucket", "models/llama")
    assert parse_model_uri("/abs/model.gguf").scheme == "local"
    assert parse_model_uri("~/m").scheme == "local"


def test_a_quantization_tag_selects_gguf_files_of_either_case():
    import fnmatch

    glob = parse_model_uri("hf://o/n:q4_k_m").filename
    assert fnmatch.fnmatchcase("model.Q4_K_M.gguf", glob) and fnmatch.fnmatchcase("model-q4_k_m.gguf", glob)
    assert not fnmatch.fnmatchcase("model.Q8_0.gguf", glob)


def test_an_existing_local_path_wins_over_an_org_name_repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert parse_model_uri("org/name").scheme == "local"
    assert parse_model_uri("org/other").scheme == "hf"


@pytest.mark.parametrize("text", ["pvc://models/llama", "oci://ghcr.io/x/y:1"])
def test_operator_side_schemes_say_they_belong_in_inference_service_specs(text):
    with pytest.raises(ModelSourceError, match="InferenceService") as info:
        parse_model_uri(text)
    assert info.value.reason == "InvalidURI"


@pytest.mark.parametrize("text", ["ftp://x/y", "hf://not-a-repo", "hf://a/b@", "hf://a/b:", "hf://a/b@v1:", "a/b:", "s3://X_Bad/p", "file://", ""])
def test_invalid_uris_name_the_accepted_forms(text):
    with pytest.raises(ModelSourceError, match="accepted forms") as info:
        parse_model_uri(text)
    assert info.value.reason == "InvalidURI" and info.value.status is None


# --- the Hub fixture --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, bytes]:
    """A tiny random LlamaForCausalLM (safetensors) with the built-in tokenizer, as repo files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slipstream.server.models.loader import load_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    tok = load_tokenizer("builtin")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    assert any(f.endswith(".safetensors") for f in files)
    return files


@pytest.fixture(scope="module")
def hub(tiny_files):
    server = HubServer()
    server.add("org/tiny", Repo({**tiny_files, "pytorch_model.bin": b"\x80pickle" * 100, "README.md": b"# tiny",
                                 ".gitattributes": b"*.bin filter=lfs"}))
    server.add("org/gated", Repo(dict(tiny_files), gated=True, allowed_tokens={TOKEN}))
    server.add("org/pickles", Repo({"config.json": b"{}", "pytorch_model.bin": b"\x80" * 10}))
    server.start()
    yield server
    server.stop()


def online(monkeypatch) -> None:
    """Undo the offline mode other test modules' conftest set (tests/clients: in the environment,
    which huggingface_hub also read into its constants when it was imported)."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    online(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no saved login of the developer's
    monkeypatch.setenv("SLIPSTREAM_MODEL_CACHE", str(tmp_path / "models"))
    hub.requests.clear()
    hub.valid_tokens, hub.rate_limited, hub.retry_after = None, 0, 1  # the module's hub is shared
    return tmp_path / "models"


def test_hf_fetch_brings_safetensors_config_and_tokenizer_and_never_a_pickle(hub, env):
    result = fetch(parse_model_uri("hf://org/tiny"), env)
    repo = hub.repos["org/tiny"]
    assert result.revision == repo.sha
    assert result.path == env / "hf" / "models--org--tiny" / "snapshots" / repo.sha
    names = {p.name for p in result.path.iterdir()}
    assert "model.safetensors" in names and "config.json" in names and "tokenizer.json" in names
    assert not names & {"pytorch_model.bin", "README.md", ".gitattributes"}
    assert hub.count(contains="pytorch_model.bin") == 0
    assert result.bytes == sum(len(repo.files[n]) for n in names)
    assert hub.count("GET", "/lfs/") == 1  # the safetensors came from the "CDN" after the 302


def test_a_second_fetch_downloads_nothing_and_a_pinned_one_asks_nothing(hub, env):
    first = fetch(parse_model_uri("hf://org/tiny"), env)
    hub.requests.clear()
    again = fetch(parse_model_uri("hf://org/tiny"), env)
    assert again.path == first.path and again.revision == first.revision
    assert hub.count(contains="/resolve/") == 0 and hub.count(contains="/lfs/") == 0
    assert hub.count(contains="/api/models/org/tiny/revision/main") == 1  # only "which commit is main?"
    hub.requests.clear()
    pinned = fetch(parse_model_uri(f"hf://org/tiny@{first.revision}"), env)
    assert pinned.revision == first.revision
    hub.requests.clear()
    assert fetch(parse_model_uri(f"hf://org/tiny@{first.revision}"), env).path == first.path
    assert hub.requests == []


def test_served_hf_model_loads_under_its_repo_name_and_answers(hub, env):
    from api.harness import Http, LoopThread, serve_app
    from slipstream.server.engine.async_llm import AsyncLLM
    from slipstream.server.engine.config import EngineConfig

    loop = LoopThread()
    try:
        async def load():
            llm = AsyncLLM(EngineConfig(model="hf://org/tiny", device="cpu", max_num_seqs=2,
                                        kv_cache_memory_bytes=4 << 20, max_model_len=128))
            await llm.start()
            return llm

        llm = loop.run(load(), timeout=120)
        with serve_app(loop, llm) as served:
            http = Http(served.url)
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["org/tiny"]
            r = http.post("/v1/completions", json={"model": "org/tiny", "prompt": "Hello", "max_tokens": 3,
                                                   "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
        loop.run(llm.shutdown())
    finally:
        loop.close()


def test_gated_repo_without_a_token_is_401_gated_and_says_to_set_hf_token(hub, env):
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/gated"), env)
    e = info.value
    assert (e.status, e.reason) == (401, "GatedRepo")
    assert "hf://org/gated" in str(e) and "401" in str(e) and "HF_TOKEN" in str(e)
    assert hub.count(contains="/lfs/") == 0


def test_gated_repo_with_a_token_without_access_is_403_and_with_access_fetches(hub, env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_other")
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/gated"), env)
    assert (info.value.status, info.value.reason) == (403, "GatedRepo")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert fetch(parse_model_uri("hf://org/gated"), env).revision == hub.repos["org/gated"].sha


def test_missing_repo_is_not_found_and_missing_revision_is_revision_not_found(hub, env, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/nope"), env)
    assert (info.value.status, info.value.reason) == (404, "NotFound")
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/tiny@v9"), env)
    assert (info.value.status, info.value.reason) == (404, "RevisionNotFound")


def test_a_404_fails_at_once_without_retries(hub, env):
    with pytest.raises(ModelSourceError):
        fetch(parse_model_uri("hf://org/nope"), env, retries=3, backoff_s=30)  # a retry would take 30 s
    assert hub.count(contains="/api/models/org/nope") == 1


def test_a_tampered_lfs_file_fails_its_checksum_is_deleted_and_an_honest_one_passes(hub, env, tiny_files):
    import hashlib

    honest = tiny_files["model.safetensors"]
    bad = honest[:-64] + bytes(64)  # as long as the listed file: only the checksum can tell
    hub.add("org/tampered", Repo(dict(tiny_files), tampered={"model.safetensors": bad}))
    want, got = hashlib.sha256(honest).hexdigest(), hashlib.sha256(bad).hexdigest()
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/tampered"), env, retries=2, backoff_s=0.01)
    e = info.value
    assert e.reason == "ChecksumMismatch" and e.status is None
    assert "hf://org/tampered" in str(e) and "model.safetensors" in str(e) and want in str(e) and got in str(e)
    assert ModelCache(env).entries() == [], "nothing is recorded as complete"
    storage = env / "hf" / "models--org--tampered"
    assert [f.name for f in (storage / "blobs").iterdir() if len(f.name) >= 64] == [], "the bad bytes are deleted"
    assert not list(storage.glob("snapshots/*/model.safetensors"))
    assert hub.count("GET", "/lfs/") == 1, "a checksum mismatch is not retried"

    hub.add("org/tampered", Repo(dict(tiny_files)))  # the same commit, served honestly
    result = fetch(parse_model_uri("hf://org/tampered"), env)
    assert (result.path / "model.safetensors").read_bytes() == honest
    assert (storage / "blobs" / want).is_file() and len(ModelCache(env).entries()) == 1


def test_a_rate_limit_is_retried_after_its_retry_after_not_the_backoff(hub, env, caplog):
    hub.add("org/busy", Repo({"config.json": b"{}", "model.safetensors": b"S" * 1000}))
    hub.rate_limited, hub.retry_after = 2, 1
    start = time.monotonic()
    with caplog.at_level(logging.WARNING):
        result = fetch(parse_model_uri("hf://org/busy"), env, retries=3, backoff_s=0.01)
    assert result.revision == hub.repos["org/busy"].sha
    assert time.monotonic() - start >= 2, "each retry waited the Retry-After (1 s), not the 0.01 s backoff"
    assert sum("429" in r.message and "try" in r.message for r in caplog.records) == 2


def test_a_rate_limit_that_lasts_fails_as_rate_limited_and_a_long_retry_after_is_bounded(hub, env, monkeypatch):
    from slipstream.server.weights import fetch as fetch_module

    hub.add("org/busy2", Repo({"config.json": b"{}", "model.safetensors": b"T" * 1000}))
    monkeypatch.setattr(fetch_module, "RETRY_AFTER_MAX_S", 0.2)
    hub.rate_limited, hub.retry_after = 100, 3600
    start = time.monotonic()
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/busy2"), env, retries=2, backoff_s=0.01)
    e = info.value
    assert (e.reason, e.status) == ("RateLimited", 429) and e.retry_after == 3600
    assert "hf://org/busy2" in str(e) and "429" in str(e) and "3600" in str(e)
    assert time.monotonic() - start < 10, "waited the bound (0.2 s), not the hour the Hub asked for"
    assert hub.count(contains="/api/models/org/busy2") == 3


def test_an_invalid_token_on_a_public_repo_is_401_naming_the_model_not_not_found(hub, env, monkeypatch, tmp_path,
                                                                                   capsys):
    from slipstream.server import cli

    hub.valid_tokens = {TOKEN}
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/tiny"), env)
    e = info.value
    assert (e.reason, e.status) == ("Unauthorized", 401)
    assert "hf://org/tiny" in str(e) and "401" in str(e) and "invalid or expired" in str(e)
    assert "not found" not in str(e).lower() and "HF_TOKEN" in str(e)
    msg = tmp_path / "termination-log"
    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(env), "--termination-message-path",
                     str(msg)]) == 1
    doc = json.loads(msg.read_text())
    assert (doc["reason"], doc["status"]) == ("Unauthorized", 401) and "invalid or expired" in doc["error"]
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert fetch(parse_model_uri("hf://org/tiny"), env).revision == hub.repos["org/tiny"].sha


def test_the_hub_fixture_sends_the_header_names_huggingface_hub_reads(hub, env):
    """hub_server.py speaks huggingface_hub's dialect: the exact header names of its constants,
    the error headers hf_raise_for_status reads, rate-limit headers its parsers understand."""
    import http.client
    import inspect
    from urllib.parse import urlsplit

    from huggingface_hub import constants
    from huggingface_hub.utils import hf_raise_for_status, parse_ratelimit_headers

    def head(path: str, headers: dict | None = None) -> tuple[int, dict[str, str]]:
        conn = http.client.HTTPConnection(urlsplit(hub.endpoint).netloc, timeout=10)
        try:
            conn.request("HEAD", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders())  # names as sent, case kept
        finally:
            conn.close()

    status, lfs = head("/org/tiny/resolve/main/model.safetensors")
    assert status == 302
    for name in (constants.HUGGINGFACE_HEADER_X_REPO_COMMIT, constants.HUGGINGFACE_HEADER_X_LINKED_ETAG,
                 constants.HUGGINGFACE_HEADER_X_LINKED_SIZE):
        assert name in lfs, (name, sorted(lfs))
    status, small = head("/org/tiny/resolve/main/config.json")
    assert status == 200 and constants.HUGGINGFACE_HEADER_X_REPO_COMMIT in small and "ETag" in small
    status, missing = head("/org/tiny/resolve/main/nope.json")
    assert status == 404 and missing["X-Error-Code"] == "EntryNotFound"
    source = inspect.getsource(hf_raise_for_status)
    assert 'headers.get("X-Error-Code")' in source and 'headers.get("X-Error-Message")' in source
    hub.valid_tokens = {TOKEN}
    status, bad_token = head("/org/tiny/resolve/main/config.json", {"Authorization": "Bearer hf_expired"})
    assert status == 401 and "X-Error-Code" not in bad_token
    assert bad_token["X-Error-Message"] == "Invalid credentials in Authorization header"
    assert '"Invalid credentials in Authorization header"' in source  # the message it tells apart
    hub.rate_limited, hub.retry_after = 1, 7
    status, limited = head("/org/tiny/resolve/main/config.json")
    assert status == 429 and limited["Retry-After"] == "7"
    info = parse_ratelimit_headers(limited)
    assert info is not None and (info.remaining, info.reset_in_seconds) == (0, 7)


def test_a_repo_with_only_pickles_is_refused_by_name(hub, env):
    with pytest.raises(ModelSourceError, match="pickle") as info:
        fetch(parse_model_uri("hf://org/pickles"), env)
    assert info.value.reason == "NotFound"
    assert hub.count(contains="pytorch_model.bin") == 0


def test_an_unreachable_hub_is_retried_with_backoff_then_reported(env, monkeypatch, caplog):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with caplog.at_level(logging.WARNING), pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("hf://org/tiny"), env, retries=2, backoff_s=0.01)
    assert info.value.reason == "Unreachable" and info.value.status is None
    assert sum("try" in r.message for r in caplog.records) == 2


def test_offline_resolves_from_the_cache_and_says_so_when_it_is_not_there(hub, env, monkeypatch):
    online = fetch(parse_model_uri("hf://org/tiny"), env)
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = fetch(parse_model_uri("hf://org/tiny"), env)
    assert (offline.path, offline.revision) == (online.path, online.revision)
    assert hub.requests == []
    with pytest.raises(ModelSourceError, match="offline") as info:
        fetch(parse_model_uri("hf://org/gated"), env)
    assert info.value.reason == "NotCached" and "unset HF_HUB_OFFLINE" in str(info.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="unset TRANSFORMERS_OFFLINE"):
        fetch(parse_model_uri("hf://org/gated"), env)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # both on: unsetting one would leave the other
    with pytest.raises(ModelSourceError, match="set HF_HUB_OFFLINE=0"):
        fetch(parse_model_uri("hf://org/gated"), env)
    with pytest.raises(ModelSourceError, match=r"drop --offline and set HF_HUB_OFFLINE=0"):  # every cause named
        fetch(parse_model_uri("hf://org/gated"), env, offline=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set, it decides (huggingface_hub's rule): an image's
    hub.requests.clear()  # TRANSFORMERS_OFFLINE=1 does not turn a pod with HF_HUB_OFFLINE=0 offline
    assert fetch(parse_model_uri("hf://org/tiny"), env).path == online.path and hub.requests
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE")
    hub.requests.clear()
    with pytest.raises(ModelSourceError, match="drop --offline") as info:  # what `slipstream download --offline` is told
        fetch(parse_model_uri("hf://org/gated"), env, offline=True)
    assert "HF_HUB_OFFLINE" not in str(info.value) and hub.requests == []
    monkeypatch.setenv("HF_HUB_OFFLINE", " 1")  # not a true value to huggingface_hub (no strip): online
    assert fetch(parse_model_uri("hf://org/tiny"), env).path == online.path and hub.requests


def download_pinned(cache: Path, model: str, tmp_path: Path) -> Path:
    """`slipstream download` as the init container runs it: the pod-local revision file it writes."""
    from slipstream.server import cli

    pin = tmp_path / "pod" / "revision.json"
    pin.parent.mkdir(exist_ok=True)
    assert cli.main(["download", model, "--cache-dir", str(cache), "--termination-message-path",
                     str(tmp_path / "termination-log"), "--revision-file", str(pin)]) == 0
    doc = json.loads(pin.read_text())
    assert doc == json.loads((tmp_path / "termination-log").read_text())  # the whole result, as the status reads it
    return pin


def move_main(hub, repo_id: str, files: dict[str, bytes], cache: Path) -> str:
    """Another service's pod fetches a newer `main` into the shared cache: refs/main moves."""
    new = hub.add(repo_id, Repo(files)).sha
    assert fetch(parse_model_uri(f"hf://{repo_id}"), cache, lease=False).revision == new
    assert (cache / "hf" / f"models--{repo_id.replace('/', '--')}" / "refs" / "main").read_text() == new
    return new


def test_a_server_restarted_in_place_serves_the_revision_its_download_step_fetched_not_a_newer_main(
        hub, env, tmp_path, monkeypatch, tiny_files):
    from slipstream.server.weights import revision_file
    from slipstream.server.models.loader import resolve_model_path

    old = hub.add("org/moving", Repo({**tiny_files, "generation_config.json": b'{"v": 1}'})).sha
    pin = download_pinned(env, "hf://org/moving", tmp_path)
    assert json.loads(pin.read_text())["revision"] == old
    new = move_main(hub, "org/moving", {**tiny_files, "generation_config.json": b'{"v": 2}'}, env)
    assert new != old
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the server container, as the operator renders it
    hub.requests.clear()
    monkeypatch.delenv(revision_file.REVISION_FILE_ENV, raising=False)
    assert fetch(parse_model_uri("hf://org/moving"), env).revision == new  # unpinned: whatever refs/main says
    monkeypatch.setenv(revision_file.REVISION_FILE_ENV, str(pin))
    path = resolve_model_path("hf://org/moving")
    assert path == env / "hf" / "models--org--moving" / "snapshots" / old
    assert (path / "generation_config.json").read_bytes() == b'{"v": 1}'
    monkeypatch.delenv("HF_HUB_OFFLINE")  # pinned, the cache only: never a newer download
    pinned = fetch(parse_model_uri("hf://org/moving"), env, pinned_revision=old)
    assert (pinned.path, pinned.revision) == (path, old) and hub.requests == []


def test_a_pinned_revision_evicted_from_the_cache_is_an_error_naming_it_and_saying_to_recreate_the_pod(
        hub, env, tmp_path, monkeypatch, tiny_files):
    from slipstream.server.weights import revision_file
    from slipstream.server.models.loader import resolve_model_path

    old = hub.add("org/evicted", Repo({**tiny_files, "generation_config.json": b'{"v": 1}'})).sha
    pin = download_pinned(env, "hf://org/evicted", tmp_path)
    move_main(hub, "org/evicted", {**tiny_files, "generation_config.json": b'{"v": 2}'}, env)
    cache = ModelCache(env)
    [entry] = [e for e in cache.entries() if e.revision == old]
    cache.remove(entry)  # what --max-cache-bytes does to the least recently used revision
    assert not (env / "hf" / "models--org--evicted" / "snapshots" / old).exists()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(revision_file.REVISION_FILE_ENV, str(pin))
    hub.requests.clear()
    with pytest.raises(ModelSourceError, match=rf"revision {old}, which the revision file names \(in a pod: what its "
                                               r"download step fetched\), is not in the model cache") as info:
        resolve_model_path("hf://org/evicted")
    assert info.value.reason == "NotCached" and "In a pod, recreate it (kubectl delete pod)" in str(info.value)
    assert "to go online" not in str(info.value) and hub.requests == []  # online would not bring it back


@pytest.mark.parametrize("model", ["builtin", "sim:tiny", "."])
def test_serve_refuses_a_revision_file_beside_a_model_that_is_not_downloaded(tmp_path, model):
    from slipstream.server import cli

    with pytest.raises(SystemExit, match=rf"--model-revision-file pins a downloaded model \(hf://, s3://\), and "
                                         rf"'{re.escape(model)}' is not one"):
        cli.main(["serve", "--model", model, "--model-revision-file", str(tmp_path / "revision.json")])


@pytest.mark.parametrize("model", ["builtin", "sim:tiny", "."])
def test_a_revision_file_beside_a_model_that_is_not_downloaded_is_refused(tmp_path, monkeypatch, model):
    from slipstream.server.weights import revision_file
    from slipstream.server.models.loader import ModelLoadError, resolve_model_path

    monkeypatch.setenv(revision_file.REVISION_FILE_ENV, str(tmp_path / "revision.json"))
    with pytest.raises(ModelLoadError, match=r"--model-revision-file pins a downloaded model \(hf://, s3://\)"):
        resolve_model_path(model)


def test_a_revision_file_that_is_missing_or_for_another_model_is_refused(hub, env, tmp_path):
    from slipstream.server.weights.revision_file import read_revision_file

    uri = parse_model_uri("hf://org/tiny")
    with pytest.raises(ModelSourceError, match="no revision file .*slipstream download --revision-file") as info:
        read_revision_file(tmp_path / "none.json", uri)
    assert info.value.reason == "NotCached"
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model": "hf://org/gated", "revision": "a" * 40}))
    with pytest.raises(ModelSourceError, match="records the model 'hf://org/gated', not this one") as info:
        read_revision_file(other, uri)
    assert info.value.reason == "InvalidURI"
    other.write_text("{}")
    with pytest.raises(ModelSourceError, match="holds no model and revision"):
        read_revision_file(other, uri)
    other.write_text(json.dumps({"model": "org/tiny", "revision": "b" * 40}))  # the same model, another spelling
    assert read_revision_file(other, uri) == "b" * 40


def test_a_gguf_selector_picks_one_file_among_decoys_and_it_loads(hub, env):
    from slipstream.server.models.loader import builtin_model_path, load_model

    gguf = builtin_model_path().read_bytes()
    hub.add("org/smol-gguf", Repo({"smol.Q4_1.gguf": gguf, "smol.Q8_0.gguf": b"GGUF decoy" * 10,
                                   "smol.F16.gguf": b"GGUF decoy 2" * 10}))
    with pytest.raises(ModelSourceError, match="3 GGUF files"):
        fetch(parse_model_uri("hf://org/smol-gguf"), env)
    result = fetch(parse_model_uri("hf://org/smol-gguf:Q4_1"), env)
    assert result.path.name == "smol.Q4_1.gguf" and result.bytes == len(gguf)
    assert hub.count(contains="Q8_0") == 0 and hub.count(contains="F16") == 0
    loaded = load_model("hf://org/smol-gguf:*Q4_1.gguf", torch.device("cpu"), torch.float32)
    assert loaded.name == "org/smol-gguf" and loaded.config.num_layers == 30


def test_an_unreachable_hub_falls_back_to_a_complete_cached_copy(hub, env, monkeypatch, caplog):
    online = fetch(parse_model_uri("hf://org/tiny"), env)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with caplog.at_level(logging.WARNING):
        again = fetch(parse_model_uri("hf://org/tiny"), env, retries=1, backoff_s=0.01)
    assert (again.path, again.revision) == (online.path, online.revision)
    assert any("serving the cached copy" in r.message for r in caplog.records)


# --- slipstream download ------------------------------------------------------------------------

def test_download_writes_the_termination_message_on_success(hub, env, tmp_path, capsys):
    from slipstream.server import cli

    msg = tmp_path / "termination-log"
    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(env), "--termination-message-path",
                     str(msg)]) == 0
    doc = json.loads(msg.read_text())
    assert set(doc) == {"model", "revision", "bytes", "seconds", "path"}
    assert doc["model"] == "hf://org/tiny" and doc["revision"] == hub.repos["org/tiny"].sha
    assert Path(doc["path"]).is_dir() and doc["bytes"] > 0 and doc["seconds"] >= 0


def test_download_writes_the_error_reason_and_status_on_failure(hub, env, tmp_path, capsys):
    from slipstream.server import cli

    msg = tmp_path / "termination-log"
    assert cli.main(["download", "hf://org/gated", "--cache-dir", str(env), "--termination-message-path",
                     str(msg)]) == 1
    doc = json.loads(msg.read_text())
    assert (doc["model"], doc["reason"], doc["status"]) == ("hf://org/gated", "GatedRepo", 401)
    assert "HF_TOKEN" in doc["error"] and "HF_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize("model, env_name, value, args", [
    ("hf://org/tiny", "HF_ENDPOINT", "http://[::1", []),      # huggingface_hub's import raised ValueError
    ("hf://org/tiny", "HF_ENDPOINT", "notaurl", []),
    ("s3://models/tiny", "AWS_ENDPOINT_URL", "notaurl", []),  # boto3 raised ValueError
    ("s3://models/tiny", None, None, ["--s3-endpoint", "ftp://store"]),
    ("hf://org/tiny", "HF_ENDPOINT", "", []),                      # set but empty: huggingface_hub used ""
    ("hf://org/tiny", "HF_ENDPOINT", "http://127.0.0.1:99999", []),
    ("s3://models/tiny", None, None, ["--s3-endpoint", "http://127.0.0.1:9/ x"]),
])
def test_download_with_an_endpoint_that_is_no_url_writes_its_reason(env, tmp_path, monkeypatch, capsys, model,
                                                                     env_name, value, args):
    from slipstream.server import cli

    for name, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}.items():
        monkeypatch.setenv(name, v)
    if env_name:
        monkeypatch.setenv(env_name, value)
    msg = tmp_path / "termination-log"
    assert cli.main(["download", model, "--cache-dir", str(env), "--termination-message-path", str(msg), *args]) == 1
    doc = json.loads(msg.read_text())
    assert doc["reason"] == "InvalidEndpoint" and doc["model"] == model, doc
    assert f"model {model!r}: " in doc["error"] and "not an http:// or https:// URL" in doc["error"]
    assert "Traceback" not in capsys.readouterr().err


def test_download_reports_an_unexpected_error_with_a_reason(env, tmp_path, monkeypatch, caplog):
    from slipstream.server import cli
    from slipstream.server.weights import fetch as fetch_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(fetch_module, "fetch", broken)
    msg = tmp_path / "termination-log"
    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(env), "--termination-message-path",
                     str(msg)]) == 1
    doc = json.loads(msg.read_text())
    assert (doc["reason"], doc["error"]) == ("Unexpected", "model 'hf://org/tiny': unexpected RuntimeError: a bug")
    assert any(r.exc_info for r in caplog.records)  # the log keeps the traceback, for the bug report


@pytest.mark.parametrize("model, says", [
    ("./no-such-dir", "no such local file or directory, and not a remote model: name one as hf://"),
    (".", "a local path: nothing to download"),
    ("sim:a100", "a sim model has no weights to download")])
def test_download_of_what_is_not_remote_says_what_it_is(env, capsys, model, says):
    from slipstream.server import cli

    assert cli.main(["download", model, "--cache-dir", str(env)]) == 1
    assert says in capsys.readouterr().err


def test_download_into_a_cache_it_cannot_write_says_so_naming_the_model(hub, env, tmp_path):
    """A cache volume the step cannot write (a hostPath not writable by the pod's user; here, as
    root, a file where the directory should be): a message, not a traceback."""
    from slipstream.server import cli

    cache, msg = tmp_path / "not-a-directory", tmp_path / "termination-log"
    cache.write_text("")
    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(cache),
                     "--termination-message-path", str(msg)]) == 1
    doc = json.loads(msg.read_text())
    assert doc["reason"] == "CacheNotWritable" and "hf://org/tiny" in doc["error"] and str(cache) in doc["error"]


def test_serve_passes_the_model_cache_dir_to_the_loader(monkeypatch, tmp_path):
    from slipstream.server import cli

    seen = {}

    async def fake_serve(engine, options, host, port):
        seen.update(model=engine.model, cache=os.environ.get("SLIPSTREAM_MODEL_CACHE"))
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    monkeypatch.setenv("SLIPSTREAM_MODEL_CACHE", "/elsewhere")
    assert cli.main(["serve", "--model", "hf://org/tiny@v1", "--model-cache-dir", str(tmp_path)]) == 0
    assert seen == {"model": "hf://org/tiny@v1", "cache": str(tmp_path)}


def test_serve_passes_the_model_revision_file_to_the_loader(monkeypatch, tmp_path):
    from slipstream.server import cli
    from slipstream.server.weights.revision_file import REVISION_FILE_ENV

    seen = {}

    async def fake_serve(engine, options, host, port):
        seen.update(model=engine.model, pin=os.environ.get(REVISION_FILE_ENV))
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    monkeypatch.setenv(REVISION_FILE_ENV, "/elsewhere")  # restored afterwards
    pin = str(tmp_path / "revision.json")
    assert cli.main(["serve", "--model", "hf://org/tiny", "--model-revision-file", pin]) == 0
    assert seen == {"model": "hf://org/tiny", "pin": pin}


@pytest.mark.parametrize("level, http_level", [("INFO", logging.WARNING), ("DEBUG", logging.NOTSET)])
def test_serve_logs_the_hub_clients_requests_only_at_debug(monkeypatch, tmp_path, level, http_level):
    """huggingface_hub's httpx logs every request at INFO: a page of lines per download in a pod's log."""
    from slipstream.server import cli

    async def fake_serve(engine, options, host, port):
        return 0

    monkeypatch.setattr("slipstream.server.api.server.serve", fake_serve)
    for name in ("httpx", "httpx2", "botocore", "urllib3"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    assert cli.main(["serve", "--model", "hf://org/tiny", "--model-cache-dir", str(tmp_path), "--log-level", level]) == 0
    assert logging.getLogger("httpx").level == logging.getLogger("botocore").level == http_level


def test_download_help_names_its_options(capsys):
    from slipstream.server import cli

    with pytest.raises(SystemExit):
        cli.main(["download", "--help"])
    text = capsys.readouterr().out
    for option in ("--cache-dir", "--s3-endpoint", "--termination-message-path", "--revision-file", "--max-cache-bytes",
                   "--offline"):
        assert option in text, option


@pytest.mark.parametrize("option, says", [(["--retries", "-1"], "--retries must be >= 0"),
                                          (["--stale-lock-seconds", "5"], "more than the lock's 5 s heartbeat"),
                                          (["--stale-lock-seconds", "-5"], "more than the lock's 5 s heartbeat")])
def test_download_refuses_settings_that_cannot_work_as_a_usage_error(env, capsys, option, says):
    """Not a traceback from deep inside the fetch (a negative --retries never tried at all)."""
    from slipstream.server import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["download", "hf://org/tiny", "--cache-dir", str(env), *option])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_download_evicts_down_to_max_cache_bytes_but_keeps_what_it_fetched(hub, env, tmp_path):
    from slipstream.server import cli

    old = tmp_path / "models" / "s3" / "b" / "old"
    old.mkdir(parents=True)
    (old / "w.gguf").write_bytes(b"x" * 1000)
    ModelCache(env).record("old", model="s3://b/old", requested="s3://b/old", revision="r", path=old, nbytes=1000)
    msg = tmp_path / "t"
    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(env), "--max-cache-bytes", "1",
                     "--termination-message-path", str(msg)]) == 0
    assert not old.exists() and Path(json.loads(msg.read_text())["path"]).exists()


def test_a_long_error_is_shortened_to_fit_the_kubelets_4096_byte_termination_message(tmp_path):
    from slipstream.server import download_cli

    msg = tmp_path / "t"
    download_cli._write(msg, {"model": "hf://o/n", "error": "x" * 10000, "reason": "NotFound", "status": 404})
    doc = json.loads(msg.read_text())
    assert len(msg.read_bytes()) <= 4096 and doc["error"].endswith("...") and doc["reason"] == "NotFound"


def test_concurrent_download_processes_fetch_each_file_once(hub, env, tmp_path):
    """Three init containers on one shared volume: one downloads, two wait and reuse its copy."""
    procs = [subprocess.Popen([sys.executable, "-m", "slipstream.server", "download", "hf://org/tiny",
                               "--cache-dir", str(env), "--termination-message-path", str(tmp_path / f"t{i}")],
                              env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(3)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert hub.count("GET", "/lfs/") == 1
    assert len({json.loads((tmp_path / f"t{i}").read_text())["path"] for i in range(3)}) == 1


# --- the shared cache's lock ------------------------------------------------------------------------

def test_a_second_holder_waits_logs_the_holder_and_gets_the_lock_after_release(tmp_path, caplog):
    a = ModelCache(tmp_path, stale_after_s=5, heartbeat_s=0.2, poll_s=0.05)
    b = ModelCache(tmp_path, stale_after_s=5, heartbeat_s=0.2, poll_s=0.05)
    b.holder = "pod-b:1"
    order = []
    with caplog.at_level(logging.INFO, logger="slipstream.model_cache"):
        with a.lock("m", "hf://o/m") as held:
            assert held.waited_since is None

            def second():
                with b.lock("m", "hf://o/m") as lock:
                    order.append(("b", lock.waited_since is not None))

            t = threading.Thread(target=second)
            t.start()
            time.sleep(0.6)  # several heartbeats: a live holder is never taken over
            order.append(("a", True))
        t.join(5)
    assert order == [("a", True), ("b", True)]
    assert any("waiting for" in r.message and a.holder in r.message and "hf://o/m" in r.message
               for r in caplog.records)


def test_a_lock_whose_heartbeat_stopped_is_taken_over(tmp_path):
    cache = ModelCache(tmp_path, stale_after_s=0.5, heartbeat_s=0.1, poll_s=0.05)
    path = cache.lock_path("m")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"holder": "gone-pod:7", "token": "t", "started": 0, "heartbeat": 0}))
    t0 = time.monotonic()
    with cache.lock("m") as lock:
        assert lock.waited_since is not None
        assert json.loads(path.read_text())["holder"] == cache.holder
    assert 0.5 <= time.monotonic() - t0 < 5
    assert not path.exists()


def test_a_lock_of_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
    code = ("import sys, time; from pathlib import Path; from slipstream.server.weights.cache import ModelCache;"
            "c = ModelCache(Path(sys.argv[1]), stale_after_s=60, heartbeat_s=1)\n"
            "with c.lock('m'):\n    print('held', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    p.kill()
    p.wait()
    t0 = time.monotonic()
    with ModelCache(tmp_path, stale_after_s=60, poll_s=0.05).lock("m"):
        pass
    assert time.monotonic() - t0 < 5


def test_eviction_removes_least_recently_used_entries_but_not_locked_or_kept_ones(tmp_path):
    cache = ModelCache(tmp_path)
    made = {}
    for i, name in enumerate(["old", "locked", "kept", "new"]):
        d = tmp_path / "s3" / "b" / name
        d.mkdir(parents=True)
        (d / "w.safetensors").write_bytes(b"x" * 100)
        e = cache.record(name, model=f"s3://b/{name}", requested=f"s3://b/{name}", revision="r", path=d, nbytes=100)
        made[name] = cache.touch(e)
        time.sleep(0.01)
    cache.lock_path("locked").parent.mkdir(parents=True, exist_ok=True)
    cache.lock_path("locked").write_text("{}")  # a fresh lock file: being fetched
    removed = evict(tmp_path, 200, keep=(str(made["kept"].path),)).removed
    assert [e.name for e in removed] == ["old", "new"]
    assert not (tmp_path / "s3" / "b" / "old").exists() and (tmp_path / "s3" / "b" / "kept").exists()
    assert {e.name for e in cache.entries()} == {"locked", "kept"}


def test_eviction_of_an_hf_revision_uses_huggingface_hubs_cache_tools(hub, env):
    result = fetch(parse_model_uri("hf://org/tiny"), env, lease=False)
    assert evict(env, 0).removed and not result.path.exists()
    assert ModelCache(env).entries() == []


# --- S3 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 on loopback (tests/s3_server.py)."""
    from s3_server import start_s3

    server = start_s3()
    yield server
    server.shutdown()


@pytest.fixture
def s3(s3_server, monkeypatch, tiny_files, tmp_path):
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": s3_server.url}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    online(monkeypatch)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    client = boto3.client("s3", endpoint_url=s3_server.url, region_name="us-east-1")
    if "models" not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
        client.create_bucket(Bucket="models")
        for name, data in tiny_files.items():
            client.put_object(Bucket="models", Key=f"tiny/{name}", Body=data)
        client.put_object(Bucket="models", Key="tiny/pytorch_model.bin", Body=b"\x80pickle")
        client.put_object(Bucket="models", Key="tiny-2/config.json", Body=b"{}")  # shares the prefix's letters
    s3_server.seen.clear()
    return client


def test_s3_fetch_brings_the_prefix_and_a_second_fetch_downloads_nothing(s3_server, s3, tmp_path, tiny_files):
    result = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache")
    assert result.path == tmp_path / "cache" / "s3" / "models" / "tiny"
    assert {p.name for p in result.path.iterdir() if not p.name.startswith(".")} == set(tiny_files)
    assert result.bytes == sum(len(v) for v in tiny_files.values())
    gets = [s for s in s3_server.seen if s[0] == "GET" and s[1].startswith("/models/tiny/")]
    assert len(gets) == len(tiny_files)
    s3_server.seen.clear()
    again = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache")
    assert again.revision == result.revision and len(result.revision) == 64
    assert [s for s in s3_server.seen if s[1].startswith("/models/tiny/")] == []  # only the listing


def test_s3_model_loads_from_the_cache(s3, tmp_path, monkeypatch):
    from slipstream.server.models.loader import load_model

    monkeypatch.setenv("SLIPSTREAM_MODEL_CACHE", str(tmp_path / "cache"))
    loaded = load_model("s3://models/tiny", torch.device("cpu"), torch.float32)
    assert loaded.name == "tiny" and loaded.config.num_layers == 1


def test_s3_changed_object_changes_the_revision_and_only_it_comes_again(s3_server, s3, tmp_path):
    first = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache")
    s3.put_object(Bucket="models", Key="tiny/generation_config.json", Body=b'{"changed": true}')
    s3_server.seen.clear()
    second = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache")
    assert second.revision != first.revision
    assert [s[1] for s in s3_server.seen if s[0] == "GET" and s[1].startswith("/models/tiny/")] == \
        ["/models/tiny/generation_config.json"]
    assert (second.path / "generation_config.json").read_bytes() == b'{"changed": true}'


def test_s3_resumes_a_partial_download_with_a_range_request(s3_server, s3, tmp_path, tiny_files):
    import hashlib

    head = s3.head_object(Bucket="models", Key="tiny/model.safetensors")
    etag = head["ETag"].strip('"')
    dest = tmp_path / "cache" / "s3" / "models" / "tiny"
    dest.mkdir(parents=True)
    partial = dest / f"model.safetensors.{hashlib.sha256(etag.encode()).hexdigest()[:12]}.partial"
    partial.write_bytes(tiny_files["model.safetensors"][:1000])
    s3_server.seen.clear()
    result = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache")
    assert (result.path / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]
    assert ("GET", "/models/tiny/model.safetensors", "bytes=1000-") in s3_server.seen


def tamper(bucket: str, key: str) -> None:
    """Flip the first byte of an object inside moto, behind the S3 API: its size, ETag and
    stored checksum stay those of the bytes uploaded (as when a store's disk rots)."""
    from moto.s3.models import s3_backends

    [stored] = [backend.buckets[bucket].keys[key] for parts in s3_backends.values()
                for backend in parts.values() if bucket in backend.buckets]
    value = stored.value
    stored.value = bytes([value[0] ^ 0xFF]) + value[1:]


def without_checksums(url: str):
    """A client that uploads without a checksum (as older SDKs and other tools do)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=Config(
        request_checksum_calculation="when_required", response_checksum_validation="when_required"))


def no_copy_left(cache: Path, name: str) -> bool:
    folder = cache / "s3" / "models" / "bad"
    return (ModelCache(cache).entries() == [] and not (folder / name).exists()
            and not list(folder.glob(f"{name}.*.partial")))


@pytest.mark.parametrize("algorithm", ["CRC32", "SHA256", None], ids=["crc32", "sha256", "etag-md5"])
def test_s3_object_whose_bytes_do_not_match_its_checksum_fails_and_leaves_no_copy(
        s3_server, s3, tmp_path, algorithm):
    data = os.urandom(3000)
    if algorithm is None:
        without_checksums(s3_server.url).put_object(Bucket="models", Key="bad/model.safetensors", Body=data)
        expected = s3.head_object(Bucket="models", Key="bad/model.safetensors")["ETag"].strip('"')
        what = "ETag (MD5)"
    else:
        put = s3.put_object(Bucket="models", Key="bad/model.safetensors", Body=data, ChecksumAlgorithm=algorithm)
        expected, what = put[f"Checksum{algorithm}"], f"checksum {algorithm}"
    s3.put_object(Bucket="models", Key="bad/config.json", Body=b"{}")
    honest = fetch(parse_model_uri("s3://models/bad"), tmp_path / "honest", lease=False)
    assert (honest.path / "model.safetensors").read_bytes() == data
    assert ("HEAD", "/models/bad/model.safetensors", "") in s3_server.seen
    tamper("models", "bad/model.safetensors")
    with pytest.raises(ModelSourceError) as info:
        fetch(parse_model_uri("s3://models/bad"), tmp_path / "cache", lease=False)
    e = info.value
    assert e.reason == "ChecksumMismatch"
    assert f"s3://models/bad/model.safetensors: {what} mismatch: expected {expected}, got " in str(e)
    assert no_copy_left(tmp_path / "cache", "model.safetensors")


def test_s3_multipart_object_without_a_checksum_is_checked_by_size_not_its_etag(s3_server, s3, tmp_path):
    client = without_checksums(s3_server.url)
    parts = [os.urandom(5 << 20), b"tail"]
    upload = client.create_multipart_upload(Bucket="models", Key="multi/model.gguf")["UploadId"]
    etags = [client.upload_part(Bucket="models", Key="multi/model.gguf", UploadId=upload, PartNumber=n,
                                Body=part)["ETag"] for n, part in enumerate(parts, 1)]
    client.complete_multipart_upload(Bucket="models", Key="multi/model.gguf", UploadId=upload, MultipartUpload={
        "Parts": [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, 1)]})
    assert s3.head_object(Bucket="models", Key="multi/model.gguf")["ETag"].endswith('-2"')  # not an MD5
    tamper("models", "multi/model.gguf")  # nothing S3 gives can tell
    result = fetch(parse_model_uri("s3://models/multi"), tmp_path / "cache", lease=False)
    assert result.path.stat().st_size == sum(map(len, parts))


def test_s3_resumed_download_is_checked_as_a_whole(s3_server, s3, tmp_path, tiny_files):
    """A ranged GET carries no checksum: the object's, from HeadObject, covers the bytes kept from
    the earlier try too; a damaged partial file is deleted and the next fetch starts over."""
    import hashlib

    etag = s3.head_object(Bucket="models", Key="tiny/model.safetensors")["ETag"].strip('"')
    dest = tmp_path / "cache" / "s3" / "models" / "tiny"
    dest.mkdir(parents=True)
    partial = dest / f"model.safetensors.{hashlib.sha256(etag.encode()).hexdigest()[:12]}.partial"
    partial.write_bytes(b"\0" * 1000)  # not the object's first 1000 bytes
    with pytest.raises(ModelSourceError, match="checksum CRC32 mismatch") as info:
        fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache", lease=False)
    assert info.value.reason == "ChecksumMismatch"
    assert ("GET", "/models/tiny/model.safetensors", "bytes=1000-") in s3_server.seen
    assert not partial.exists() and not (dest / "model.safetensors").exists()
    assert ModelCache(tmp_path / "cache").entries() == []
    result = fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache", lease=False)
    assert (result.path / "model.safetensors").read_bytes() == tiny_files["model.safetensors"]


def test_s3_missing_prefix_and_bucket_are_not_found(s3, tmp_path):
    for uri in ("s3://models/nothing-here", "s3://no-such-bucket/tiny"):
        with pytest.raises(ModelSourceError) as info:
            fetch(parse_model_uri(uri), tmp_path / "cache")
        assert info.value.reason == "NotFound" and uri in str(info.value), uri


def test_s3_wrong_credentials_are_unauthorized_and_say_what_to_set(s3_server, s3, tmp_path, monkeypatch):
    import requests

    requests.post(f"{s3_server.url}/moto-api/reset-auth", data=b"0").raise_for_status()  # check signatures
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        with pytest.raises(ModelSourceError) as info:
            fetch(parse_model_uri("s3://models/tiny"), tmp_path / "cache", retries=0)
    finally:
        requests.post(f"{s3_server.url}/moto-api/reset-auth", data=b"inf").raise_for_status()
    e = info.value
    assert (e.reason, e.status) == ("Unauthorized", 403)
    assert "AWS_ACCESS_KEY_ID" in str(e) and "s3://models/tiny" in str(e) and "403" in str(e)


def test_s3_uri_of_one_object_fetches_that_file(s3, tmp_path):
    s3.put_object(Bucket="models", Key="ggufs/one.Q4_0.gguf", Body=b"GGUF" + b"\0" * 60)
    result = fetch(parse_model_uri("s3://models/ggufs/one.Q4_0.gguf"), tmp_path / "cache")
    assert result.path.name == "one.Q4_0.gguf" and result.path.read_bytes()[:4] == b"GGUF" and result.bytes == 64


def test_s3_pinned_server_serves_its_pods_copy_and_refuses_one_a_later_fetch_rewrote(s3, tmp_path, monkeypatch,
                                                                                      tiny_files):
    """An S3 prefix has one copy in the cache, rewritten in place when a later fetch (another
    service's pod) finds changed objects: pinned, a server restarted in place refuses to serve
    bytes its pod's download step did not fetch."""
    from slipstream.server.weights import revision_file
    from slipstream.server.models.loader import resolve_model_path

    for name, data in tiny_files.items():
        s3.put_object(Bucket="models", Key=f"pinned/{name}", Body=data)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SLIPSTREAM_MODEL_CACHE", str(cache))
    pin = download_pinned(cache, "s3://models/pinned", tmp_path)
    old = json.loads(pin.read_text())["revision"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(revision_file.REVISION_FILE_ENV, str(pin))
    assert resolve_model_path("s3://models/pinned") == cache / "s3" / "models" / "pinned"
    s3.put_object(Bucket="models", Key="pinned/generation_config.json", Body=b'{"changed": true}')
    monkeypatch.delenv("HF_HUB_OFFLINE")
    new = fetch(parse_model_uri("s3://models/pinned"), cache, lease=False).revision
    assert new != old
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(revision_file.REVISION_FILE_ENV)
    assert fetch(parse_model_uri("s3://models/pinned"), cache).revision == new  # unpinned: the rewritten copy
    monkeypatch.setenv(revision_file.REVISION_FILE_ENV, str(pin))
    with pytest.raises(ModelSourceError, match=f"revision {old}, which the revision file names .* is not in the "
                                               f"model cache .*now holds revision {new}") as info:
        resolve_model_path("s3://models/pinned")
    assert info.value.reason == "NotCached" and "In a pod, recreate it (kubectl delete pod)" in str(info.value)


def test_a_directory_holding_one_gguf_file_loads_that_file(tmp_path):
    """A model image's /models (oci:// in an InferenceService) holds the GGUF and nothing else."""
    from slipstream.server.models.loader import builtin_model_path, resolve_model_path

    (tmp_path / "model.gguf").symlink_to(builtin_model_path())
    (tmp_path / "README.md").write_text("a model image")
    assert resolve_model_path(str(tmp_path)) == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelSourceError, match="2 GGUF files"):
        resolve_model_path(str(tmp_path))


def test_eviction_in_a_copied_cache_touches_only_that_cache(hub, env, tmp_path):
    """Entries name their files relative to the cache root: a copy (or another mount point) of a
    cache evicts its own files, never the original's."""
    import shutil

    from slipstream.server import cli

    assert cli.main(["download", "hf://org/tiny", "--cache-dir", str(env)]) == 0
    copy = tmp_path / "copy"
    shutil.copytree(env, copy, symlinks=True)
    [entry] = ModelCache(copy).entries()
    assert Path(entry.path).is_relative_to(copy)
    assert [e.model for e in evict(copy, 0).removed] == ["hf://org/tiny"]
    assert not list((copy / "hf").glob("models--org--tiny/snapshots/*/config.json"))
    assert list((env / "hf").glob("models--org--tiny/snapshots/*/config.json")), "the original cache lost files"


def test_removal_never_leaves_the_cache_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.gguf").write_bytes(b"x")
    cache = ModelCache(tmp_path / "cache")
    entry = cache.record("x", model="s3://b/x", requested="s3://b/x", revision="r", path=outside / "keep.gguf", nbytes=1)
    cache.remove(entry)
    assert (outside / "keep.gguf").exists()


def test_a_file_selector_picks_weights_only_never_a_pickle_or_readme():
    from slipstream.server.weights.hf import select_files

    files = ["config.json", "pytorch_model.bin", "README.md", "a.Q4_0.gguf", "a.Q8_0.gguf"]
    for selector in ("*.bin", "README.md"):
        with pytest.raises(ModelSourceError, match="not GGUF or safetensors"):
            select_files(parse_model_uri(f"hf://o/n:{selector}"), files)
    with pytest.raises(ModelSourceError, match="matches 2 GGUF files") as info:
        select_files(parse_model_uri("hf://o/n:*.gguf"), files)
    assert info.value.reason == "InvalidURI"
    assert select_files(parse_model_uri("hf://o/n:Q8_0"), files) == ["a.Q8_0.gguf", "config.json"]


def test_a_mistral_repository_downloads_the_hugging_face_format_only():
    from slipstream.server.weights.hf import select_files

    files = ["config.json", "params.json", "consolidated.safetensors", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    assert [f for f in select_files(parse_model_uri("hf://mistralai/m"), files) if f.endswith(".safetensors")] == \
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert select_files(parse_model_uri("hf://o/n"), ["config.json", "consolidated.safetensors"])[1] == \
        "consolidated.safetensors"  # nothing else to load


def test_a_truncated_safetensors_file_is_a_load_error_not_a_traceback(tmp_path, tiny_files):
    from slipstream.server.models.loader import ModelLoadError, load_model

    for name, data in tiny_files.items():
        (tmp_path / name).write_bytes(data[:100] if name.endswith(".safetensors") else data)
    with pytest.raises(ModelLoadError, match="truncated or damaged"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float32)


def test_an_unwritable_termination_message_path_is_reported_not_raised(tmp_path, capsys):
    from slipstream.server import download_cli

    download_cli._write(tmp_path / "no" / "such" / "dir", {"model": "m", "error": "e", "reason": "r", "status": None})
    assert "cannot write the termination message" in capsys.readouterr().err


def test_a_split_gguf_model_is_refused_naming_its_shards_and_the_merge_before_downloading(hub, env, tmp_path):
    import gguf
    import numpy as np

    from slipstream.server.weights.errors import ModelLoadError
    from slipstream.server.models.loader import load_model

    hub.add("org/split", Repo({"m-Q4_K_M-00001-of-00002.gguf": b"GGUF 1" * 10,
                               "m-Q4_K_M-00002-of-00002.gguf": b"GGUF 2" * 10, "m-Q8_0.gguf": b"GGUF 3" * 10}))
    with pytest.raises(ModelSourceError, match=r"split into 2 shards .*llama-gguf-split --merge") as e:
        fetch(parse_model_uri("hf://org/split:Q4_K_M"), env)
    assert e.value.reason == "InvalidURI" and hub.count(contains="/lfs/") == 0
    # one shard on disk: the loader reads split.count and says the same
    shard = tmp_path / "m-00001-of-00002.gguf"
    w = gguf.GGUFWriter(str(shard), "llama")
    w.add_uint16("split.count", 2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="one of 2 shards of a split GGUF model.*llama-gguf-split --merge"):
        load_model(str(shard), torch.device("cpu"), torch.float32)


# --- progress -----------------------------------------------------------------------------------

class _Terminal:
    """A stderr that says it is a terminal and keeps what is written to it."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.text.append(s)
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [True, False])
def test_hub_and_s3_weights_draw_a_progress_bar_on_a_terminal_only(hub, env, s3, tmp_path, monkeypatch, tty):
    for uri, cache in (("hf://org/tiny", env), ("s3://models/tiny", tmp_path / "s3-cache")):
        stderr = _Terminal(tty)
        monkeypatch.setattr(sys, "stderr", stderr)
        fetch(parse_model_uri(uri), cache)
        drawn = "".join(stderr.text)
        if tty:
            assert "model.safetensors:" in drawn and "/3.01M [" in drawn, (uri, drawn[-500:])  # name, total
        else:
            assert "%|" not in drawn, uri


def test_a_slow_download_logs_progress_lines(hub, env, monkeypatch, caplog):
    from slipstream.server.weights import progress

    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.1)
    hub.trickle = (1 << 20, 0.3)
    try:
        with caplog.at_level(logging.INFO, logger="slipstream.sources"):
            fetch(parse_model_uri("hf://org/tiny"), env)
    finally:
        hub.trickle = None
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fetching hf://org/tiny: ")]
    assert lines and all("MB so far" in line and "MB/s" in line for line in lines), caplog.text[-1000:]
