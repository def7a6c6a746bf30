"""The shared model cache beyond its lock: in-use leases that keep a served revision from eviction,
partial files of downloads that died, byte counts of what a URI selected, and a download stopped
by a signal (the lock released, exit 128 + signal). Loopback Hub (hub_server.py) and moto S3 only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hub_server import HubServer, Repo
from slipstream.server.weights import disk_cache, holders
from slipstream.server.weights.cache import Entry, ModelCache
from slipstream.server.weights.eviction import Partial, evict, files_root, orphans, pinned_by
from slipstream.server.weights.holders import gone, lease_holder
from slipstream.server.weights.leases import LeaseRecord, live_leases
from slipstream.server.weights.errors import ModelSourceError
from slipstream.server.weights.fetch import fetch
from slipstream.server.weights.uri import parse_model_uri

BIG = 24 << 20  # bytes: more than two of huggingface_hub's 10 MiB chunks


def _entry(cache: ModelCache, root: Path, name: str, nbytes: int = 100) -> Entry:
    d = root / "s3" / "b" / name
    d.mkdir(parents=True)
    (d / "w.safetensors").write_bytes(b"x" * nbytes)
    entry = cache.record(name, model=f"s3://b/{name}", requested=f"s3://b/{name}", revision="r", path=d,
                         nbytes=nbytes)
    time.sleep(0.01)  # distinct last_used
    return cache.touch(entry)


def _hold_lease(root: Path, name: str, path: Path, hostname: str | None = None) -> subprocess.Popen:
    """Another process (a pod's server, named ``hostname`` if given) that leases ``name`` and then waits."""
    code = ("import sys, time; from pathlib import Path; from slipstream.server.weights.cache import ModelCache\n"
            "ModelCache(Path(sys.argv[1])).lease(sys.argv[2], 'r', Path(sys.argv[3]))\n"
            "print('leased', flush=True); sys.stdin.readline()")
    env = {**os.environ, "HOSTNAME": hostname} if hostname else None
    p = subprocess.Popen([sys.executable, "-c", code, str(root), name, str(path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "leased"
    return p


# --- leases -------------------------------------------------------------------------------------

def test_a_leased_entry_outlives_eviction_until_its_holder_on_this_host_dies(tmp_path):
    cache = ModelCache(tmp_path)
    served, idle = _entry(cache, tmp_path, "served"), _entry(cache, tmp_path, "idle")
    holder = _hold_lease(tmp_path, "served", Path(served.path))
    try:
        done = evict(tmp_path, 0)
        assert [e.name for e in done.removed] == ["idle"] and [e.name for e in done.in_use] == ["served"]
        assert Path(served.path).exists() and not Path(idle.path).exists()
        assert done.total_bytes == 100  # above max_bytes: what is left is in use
    finally:
        holder.kill()  # no clean exit: the lease file stays
        holder.wait()
    done = evict(tmp_path, 0)  # its host and pid namespace are ours and the pid is gone: swept at once
    assert [e.name for e in done.removed] == ["served"] and not Path(served.path).exists()
    assert list((tmp_path / ".slipstream" / "leases").iterdir()) == []


def test_a_lease_of_another_pod_that_died_pins_its_entry_until_it_goes_stale(tmp_path):
    """Another host name (a pod): its pid means nothing here, so only the heartbeat's age ends it."""
    cache = ModelCache(tmp_path)
    served = _entry(cache, tmp_path, "served")
    holder = _hold_lease(tmp_path, "served", Path(served.path), hostname="other-pod")
    holder.kill()
    holder.wait()
    assert cache.leases()[0].holder == f"other-pod:{holder.pid}"
    assert evict(tmp_path, 0).in_use, "a lease is live for LEASE_STALE_AFTER_S after its last heartbeat"
    time.sleep(0.3)
    done = evict(tmp_path, 0, lease_stale_after_s=0.2)
    assert [e.name for e in done.removed] == ["served"] and not Path(served.path).exists()
    assert list((tmp_path / ".slipstream" / "leases").iterdir()) == []


def test_a_heartbeat_that_is_no_time_never_pins_and_an_unreadable_lease_is_swept_when_old(tmp_path):
    cache = ModelCache(tmp_path)
    served = _entry(cache, tmp_path, "served")
    leases = tmp_path / ".slipstream" / "leases"
    leases.mkdir(parents=True)
    record = {"holder": "other-pod:7", "name": "served", "revision": "r", "path": "s3/b/served", "started": 0}
    for beat in ("Infinity", "NaN", str(time.time() + 10 ** 9)):  # json.loads reads the first two as floats
        (leases / "bogus.json").write_text(json.dumps(record)[:-1] + f', "heartbeat": {beat}}}')
        [lease] = cache.leases()
        assert live_leases([lease], time.time(), 60.0) == [], beat
    now = time.time()
    skewed = LeaseRecord("other-pod:7", "served", "r", served.path, now + 5)  # another node's clock, a little ahead
    assert live_leases([skewed], now, 60.0) == [skewed]
    (leases / "bogus.json").unlink()
    corrupt = leases / "corrupt.json"
    corrupt.write_text("{not json")
    [lease] = cache.leases()
    assert (lease.holder, lease.name, lease.file) == ("unknown", "", str(corrupt))
    assert [e.name for e in evict(tmp_path, 0).removed] == ["served"], "it pins nothing"
    assert corrupt.exists(), "fresh: perhaps a newer version's, left until stale"
    old = time.time() - 3600
    os.utime(corrupt, (old, old))
    evict(tmp_path, 0, lease_stale_after_s=60.0)
    assert not corrupt.exists()


def test_a_failed_atomic_write_leaves_no_temporary_and_eviction_sweeps_old_ones_of_killed_writers(tmp_path):
    target = tmp_path / "entry.json"
    with pytest.raises(OSError):  # the rename fails: a directory stands at the target
        target.mkdir()
        disk_cache.write_atomic(target, "{}")
    assert [f.name for f in tmp_path.iterdir()] == ["entry.json"]
    target.rmdir()
    longest = tmp_path / ("r" * 250)  # near NAME_MAX: its temporary still fits
    disk_cache.write_atomic(longest, "{}")
    assert [f.name for f in tmp_path.iterdir() if f.name != "entry.json"] == [longest.name]
    longest.unlink()
    # What a process killed between the write and the rename leaves: one in the metadata, one
    # beside a Hub ref; a fresh one may be a write in progress, and a look-alike is not ours.
    meta = tmp_path / ".slipstream" / "entries" / "m"
    meta.mkdir(parents=True)
    ref = tmp_path / "hf" / "models--o--n" / "refs"
    ref.mkdir(parents=True)
    old_meta, old_ref = meta / ".r.json.0123abcd.tmp", ref / ".main.89abcdef.tmp"
    fresh, other = meta / ".q.json.fedcba98.tmp", meta / ".notes.tmp"
    model_file = tmp_path / "s3" / "b" / "m" / ".notes.txt.cafebabe.tmp"  # an object of the model's
    model_file.parent.mkdir(parents=True)
    for f in (old_meta, old_ref, fresh, other, model_file):
        f.write_text("{")
    old = time.time() - 3600
    for f in (old_meta, old_ref, other, model_file):
        os.utime(f, (old, old))
    evict(tmp_path, 1 << 30, lease_stale_after_s=60.0)
    assert not old_meta.exists() and not old_ref.exists()
    assert fresh.exists() and other.exists() and model_file.exists()


def test_a_holder_is_gone_only_when_its_host_and_pid_namespace_are_ours_and_its_pid_is_free():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    here, ns = lease_holder().rpartition(":")[0], holders.PIDNS
    assert ns.startswith("pid:")
    assert gone(f"{here}:{p.pid}", ns)
    assert not gone(f"{here}:{os.getpid()}", ns)  # alive
    assert not gone(f"{here}:{p.pid}", "pid:[1]")  # another namespace (hostNetwork pods share the node's name)
    assert not gone(f"{here}:{p.pid}", "")  # written by an older version: unknown
    assert not gone(f"other-pod:{p.pid}", ns)
    assert not gone(f"{here}:99999999999999999999", ns), "no such pid can exist: unknown, not a crash"
    assert not gone(f"{here}:\u00b2", ns), "a digit to str.isdigit, not to int()"


def test_a_clean_exit_releases_the_lease(tmp_path):
    cache = ModelCache(tmp_path)
    entry = _entry(cache, tmp_path, "m")
    holder = _hold_lease(tmp_path, "m", Path(entry.path))
    assert len(cache.leases()) == 1 and cache.leases()[0].holder.endswith(f":{holder.pid}")
    holder.communicate("\n", timeout=30)  # returns from the script: atexit runs
    assert holder.returncode == 0 and cache.leases() == []
    assert [e.name for e in evict(tmp_path, 0).removed] == ["m"]


def test_a_lease_taken_while_eviction_decides_keeps_the_entry(tmp_path):
    """A server leases the entry just after eviction looked at the leases' folder once: eviction
    reads the leases again after removing the marker, sees it and puts the marker back."""
    cache = ModelCache(tmp_path)
    entry = _entry(cache, tmp_path, "m")
    unmark, taken = cache.unmark, []

    def unmark_then_a_server_leases(e):
        unmark(e)
        taken.append(ModelCache(tmp_path).lease(e.name, e.revision, Path(e.path)))

    cache.unmark = unmark_then_a_server_leases
    done = evict(tmp_path, 0, cache=cache)
    assert [e.name for e in done.in_use] == ["m"] and done.removed == []
    assert Path(entry.path).exists() and cache.marked("m", "r") and cache.find("m", "r")
    taken[0].release()


def test_a_lease_on_an_entry_eviction_has_unmarked_fails_instead_of_serving_vanishing_files(tmp_path, monkeypatch):
    from slipstream.server.weights import fetch as fetch_module

    monkeypatch.setattr(fetch_module, "LEASE_CONFIRM_S", 0.2)
    cache = ModelCache(tmp_path)
    entry = _entry(cache, tmp_path, "m")
    held = fetch_module._hold(cache, "m", "r", Path(entry.path), "s3://b/m")
    assert held is not None and len(cache.leases()) == 1
    held.release()
    cache.unmark(entry)  # an eviction that saw no lease: the files go next
    with pytest.raises(ModelSourceError, match="evicted") as e:
        fetch_module._hold(cache, "m", "r", Path(entry.path), "s3://b/m")
    assert e.value.reason == "NotCached" and cache.leases() == []


def test_leasing_twice_in_one_process_is_one_lease_and_release_ends_it(tmp_path):
    cache = ModelCache(tmp_path)
    entry = _entry(cache, tmp_path, "m")
    first = cache.lease("m", "r", Path(entry.path))
    assert cache.lease("m", "r", Path(entry.path)) is first and len(cache.leases()) == 1
    first.release()
    first.release()
    assert cache.leases() == [] and evict(tmp_path, 0).removed


def test_a_lease_on_one_file_of_a_snapshot_pins_every_entry_that_shares_it():
    snap = "/c/hf/models--org--q/snapshots/abc"
    q4 = Entry("q4", "hf://org/q:Q4_0", "org/q:Q4_0", "abc", f"{snap}/q.Q4_0.gguf", 10, 0, 0)
    q8 = Entry("q8", "hf://org/q:Q8_0", "org/q:Q8_0", "abc", f"{snap}/q.Q8_0.gguf", 10, 0, 0)
    other = Entry("o", "hf://org/o", "org/o", "def", "/c/hf/models--org--o/snapshots/def", 10, 0, 0)
    lease = LeaseRecord("pod:1", "q4", "abc", f"{snap}/q.Q4_0.gguf", heartbeat=100.0)
    assert files_root(q4.path, "abc") == files_root(q8.path, "abc") == "/c/hf/models--org--q@abc"
    assert files_root("/c/s3/b/m.d/m.gguf", "r") == "/c/s3/b/m.d" and files_root("/c/s3/b/m", "r") == "/c/s3/b/m"
    assert pinned_by(q8, [lease]) == [lease] and pinned_by(other, [lease]) == []
    assert live_leases([lease], now=150.0, stale_after=60) == [lease]
    assert live_leases([lease], now=161.0, stale_after=60) == []


# --- partial files ------------------------------------------------------------------------------

def test_orphans_are_old_partial_files_outside_every_live_download():
    files = [Partial("/c/hf/models--o--a/blobs/x.incomplete", 5, 10.0),
             Partial("/c/hf/models--o--b/blobs/y.incomplete", 5, 20.0),
             Partial("/c/s3/b/m/w.1.partial", 5, 5.0),
             Partial("/c/s3/b/n/w.2.partial", 5, 99.0)]
    got = orphans(files, "/c", ["hf/models--o--b"], now=100.0, stale_after=30)
    assert [p.path for p in got] == ["/c/s3/b/m/w.1.partial", "/c/hf/models--o--a/blobs/x.incomplete"]
    assert orphans(files, "/c", None, now=100.0, stale_after=30) == [], "a lock that names no folders"


def test_eviction_removes_orphaned_partial_files_first_and_counts_them(tmp_path):
    cache = ModelCache(tmp_path, stale_after_s=30)
    entry = _entry(cache, tmp_path, "m")
    dead = tmp_path / "hf" / "models--org--dead" / "blobs" / "abc.1234.incomplete"
    busy = tmp_path / "s3" / "b" / "busy" / "w.safetensors.ab12.partial"
    fresh = tmp_path / "s3" / "b" / "fresh" / "w.safetensors.cd34.partial"
    for f in (dead, busy, fresh):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"p" * 1000)
    os.utime(dead, (time.time() - 3600,) * 2)
    os.utime(busy, (time.time() - 3600,) * 2)
    with cache.lock("busy", "s3://b/busy", writes=["s3/b/busy"]):
        done = evict(tmp_path, 2100)
    assert [Path(p.path).name for p in done.orphans] == [dead.name]
    assert not dead.exists() and busy.exists() and fresh.exists()
    assert done.removed == [] and done.total_bytes == 2100 and Path(entry.path).exists()
    done = evict(tmp_path, 1000)  # the lock is gone: `busy` is an orphan now, then the entry goes
    assert [Path(p.path).name for p in done.orphans] == [busy.name] and [e.name for e in done.removed] == ["m"]
    assert fresh.exists() and done.total_bytes == 1000


# --- byte counts and refusals before downloading -----------------------------------------------

@pytest.fixture(scope="module")
def hub():
    server = HubServer()
    server.add("org/ggufs", Repo({"m.Q4_0.gguf": b"G" * 3000, "m.Q8_0.gguf": b"H" * 5000, "README.md": b"# m"}))
    server.add("org/big", Repo({"config.json": b'{"model_type": "llama"}',
                                "model.safetensors": os.urandom(BIG)}))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    """Online (other modules' conftest sets HF_HUB_OFFLINE in the environment), against the
    loopback hub; returns the model cache folder."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    hub.requests.clear()
    hub.trickle = None
    return tmp_path / "models"


def test_bytes_count_the_selected_file_not_the_other_quantizations_in_the_same_snapshot(hub, env):
    q4 = fetch(parse_model_uri("hf://org/ggufs:Q4_0"), env, lease=False)
    q8 = fetch(parse_model_uri("hf://org/ggufs:Q8_0"), env, lease=False)
    assert q4.path.parent == q8.path.parent, "one snapshot folder holds both"
    assert (q4.bytes, q8.bytes) == (3000, 5000)
    assert sorted(e.bytes for e in ModelCache(env).entries()) == [3000, 5000]


def test_revisions_that_share_a_blob_count_it_once_and_eviction_keeps_it_for_the_other(hub, env):
    weights = b"W" * 6000
    hub.add("org/revs", Repo({"config.json": b'{"v": 1}', "model.safetensors": weights}))
    old = fetch(parse_model_uri("hf://org/revs"), env, lease=False)
    hub.add("org/revs", Repo({"config.json": b'{"v": 2}', "model.safetensors": weights}))  # a new commit on main
    new = fetch(parse_model_uri("hf://org/revs"), env, lease=False)
    assert old.revision != new.revision and old.bytes == new.bytes == 6008
    assert (old.path / "model.safetensors").resolve() == (new.path / "model.safetensors").resolve(), "one blob"
    done = evict(env, 6016)  # both fit: one blob and two configs
    assert done.removed == [] and done.total_bytes == 6016
    done = evict(env, 6010)  # the older revision goes; the weights stay, the newer one links them
    assert [e.revision for e in done.removed] == [old.revision] and done.total_bytes == 6008
    assert (new.path / "model.safetensors").read_bytes() == weights and not old.path.exists()
    done = evict(env, 0)
    assert [e.revision for e in done.removed] == [new.revision] and done.total_bytes == 0


def test_an_s3_prefix_of_several_ggufs_is_refused_before_downloading_any(env, tmp_path, monkeypatch):
    import boto3
    from s3_server import start_s3

    server = start_s3()
    try:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": server.url}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        s3 = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
        s3.create_bucket(Bucket="ggufs")
        for key in ("m/m.Q4_0.gguf", "m/m.Q8_0.gguf"):
            s3.put_object(Bucket="ggufs", Key=key, Body=b"G" * 100)
        server.seen.clear()
        with pytest.raises(ModelSourceError, match=r"2 GGUF files .*s3://ggufs/m/m\.Q4_0\.gguf") as e:
            fetch(parse_model_uri("s3://ggufs/m"), tmp_path / "cache")
        assert e.value.reason == "InvalidURI"
        assert [s for s in server.seen if s[0] == "GET" and s[1].endswith(".gguf")] == []
        one = fetch(parse_model_uri("s3://ggufs/m/m.Q8_0.gguf"), tmp_path / "cache", lease=False)
        assert one.path.name == "m.Q8_0.gguf" and one.bytes == 100
    finally:
        server.shutdown()


# --- a download stopped by a signal --------------------------------------------------------------

def _download(env: Path, tmp_path: Path, model: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "slipstream.server", "download", model,
                             "--cache-dir", str(env), "--termination-message-path", str(tmp_path / "t")],
                            env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_bytes(hub: HubServer, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sum(hub.sent.values()) < at_least:
        assert time.monotonic() < deadline, "the download never started"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_a_download_midway_releases_its_lock_and_exits_128_plus_it(hub, env, tmp_path, signum):
    hub.trickle = (256 << 10, 0.1)  # 2.5 MiB/s: the whole file would take ~10 s
    hub.sent.clear()
    p = _download(env, tmp_path, "hf://org/big")
    _wait_for_bytes(hub, 1 << 20)
    at_signal = sum(hub.sent.values())
    p.send_signal(signum)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 128 + signum, out
    # within a chunk or two (1 MiB each), not huggingface_hub's 10 MiB: seconds on a slow link
    assert sum(hub.sent.values()) - at_signal < 3 << 20, "it read on long after the signal"
    doc = json.loads((tmp_path / "t").read_text())
    assert doc["reason"] == "Interrupted" and signal.Signals(signum).name in doc["error"]
    assert not list((env / ".slipstream" / "locks").glob("*.lock")), "the lock is released"
    assert ModelCache(env).entries() == [], "nothing is recorded as complete"

    hub.trickle = None  # another pod takes over at once and finishes, resuming the partial file
    hub.ranges.clear()
    again = _download(env, tmp_path, "hf://org/big")
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0, out
    assert json.loads((tmp_path / "t").read_text())["bytes"] == BIG + len(b'{"model_type": "llama"}')
    assert [r for p, r in hub.ranges if p.startswith("/lfs/")], "the second download resumed with a Range request"
    assert sum(n for p, n in hub.sent.items() if p.startswith("/lfs/")) < 2 * BIG


def test_a_download_killed_midway_resumes_its_partial_file_with_a_range_request(hub, env, tmp_path):
    """SIGKILL (an OOM kill, a node lost): nothing runs on the way out. The next download finds
    the partial blob, asks for the rest (Range: bytes=N-), checks the whole file's sha256 and
    serves the same bytes; fewer than two files' worth of bytes crossed the wire in all."""
    import hashlib

    weights = hub.repos["org/big"].files["model.safetensors"]
    hub.trickle = (256 << 10, 0.1)
    hub.sent.clear()
    hub.ranges.clear()
    p = _download(env, tmp_path, "hf://org/big")
    _wait_for_bytes(hub, 6 << 20)
    p.kill()
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    first = sum(hub.sent.values())
    assert first < BIG, "killed midway"
    assert ModelCache(env).entries() == []
    partial = env / "hf" / "models--org--big" / "blobs" / f"{hashlib.sha256(weights).hexdigest()}.incomplete"
    assert partial.is_file() and partial.stat().st_size > 0, "the partial file is where the next try looks"

    hub.trickle = None
    again = _download(env, tmp_path, "hf://org/big")
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0, out
    lfs = [(path, r) for path, r in hub.ranges if path.startswith("/lfs/")]
    assert len(lfs) == 1 and lfs[0][1].startswith("bytes=") and int(lfs[0][1][6:-1]) > 0, hub.ranges
    assert sum(n for path, n in hub.sent.items() if path.startswith("/lfs/")) < 2 * BIG
    path = Path(json.loads((tmp_path / "t").read_text())["path"])
    assert (path / "model.safetensors").read_bytes() == weights and not partial.exists()
    assert len(ModelCache(env).entries()) == 1


def test_a_signal_while_serve_fetches_its_model_stops_the_fetch_and_exits_143(hub, env, tmp_path):
    hub.trickle = (1 << 20, 0.15)
    hub.sent.clear()
    p = subprocess.Popen([sys.executable, "-m", "slipstream.server", "serve", "--model", "hf://org/big",
                          "--model-cache-dir", str(env), "--host", "127.0.0.1", "--port", "0"],
                         env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_bytes(hub, 1 << 20)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == 143, out
    assert sum(hub.sent.values()) < BIG
    assert not list((env / ".slipstream" / "locks").glob("*.lock"))


# --- evictions at once ------------------------------------------------------------------------------

def test_evictions_that_run_at_once_on_one_cache_all_finish_and_meet_the_budget(hub, env):
    """Pods that finish their downloads together evict together: each walks folders that another
    is removing. None fails (a download that fetched fine must not exit as CacheNotWritable),
    nothing is removed twice, and the budget holds at the end."""
    import threading

    for round_ in range(3):
        names = [f"org/evict{round_}-{i}" for i in range(8)]
        for i, name in enumerate(names):
            hub.add(name, Repo({"config.json": b'{"model_type": "llama"}',
                                "model.safetensors": bytes([i]) * 4000, "tokenizer.json": b"{}"}))
            fetch(parse_model_uri(f"hf://{name}"), env, lease=False)
        for f in (env / "hf").glob("*/blobs/*"):  # partial files of downloads that died, for the scan
            (f.parent / f"{f.name[:8]}.dead.incomplete").write_bytes(b"p")
        go = threading.Barrier(6)
        errors, done = [], []

        def evict_now():
            go.wait()
            try:
                done.append(evict(env, 4100))
            except Exception as e:  # noqa: BLE001 - what the test is about
                errors.append(e)

        threads = [threading.Thread(target=evict_now) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], errors
        removed = [e.model for d in done for e in d.removed]
        assert len(removed) == len(set(removed)), "an entry evicted twice"
        assert evict(env, 4100).total_bytes <= 4100
        left = ModelCache(env).entries()
        assert len(left) <= 1 and all(Path(e.path).is_dir() for e in left)
