"""The derived-file cache keeps one entry per source path: writing a new one removes the older
entries of the same path, and nothing else that might be in use."""
from __future__ import annotations

import json
import os
import time

import pytest

from slipstream.server.weights.disk_cache import UNLABELLED_MAX_AGE_S, cache_entry, fill_cache, stale_entries


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _source(tmp_path, name="model.gguf", mtime=1_000_000_000):
    path = tmp_path / name
    path.write_bytes(b"gguf")
    os.utime(path, (mtime, mtime))
    return path


def _fill(path, kind="weights"):
    entry = cache_entry(path, kind)
    fill_cache(entry, lambda tmp: (tmp / "data").write_text(str(path.stat().st_mtime_ns)), path)
    return entry


def test_an_entry_is_labelled_with_its_resolved_source(tmp_path, cache):
    path = _source(tmp_path)
    entry = _fill(path)
    assert (entry / "data").is_file()
    assert json.loads((entry / "source.json").read_text()) == {"path": str(path.resolve())}


def test_a_changed_file_replaces_its_old_entry(tmp_path, cache):
    path = _source(tmp_path)
    old = _fill(path)
    os.utime(path, (2_000_000_000, 2_000_000_000))
    new = _fill(path)
    assert new != old and new.is_dir() and not old.exists()
    assert [p.name for p in (cache / "weights").iterdir()] == [new.name]


def test_entries_of_other_files_and_other_kinds_are_kept(tmp_path, cache):
    path, other = _source(tmp_path), _source(tmp_path, "other.gguf")
    kept = [_fill(other), _fill(path, "tokenizers")]
    _fill(path)
    os.utime(path, (2_000_000_000, 2_000_000_000))
    _fill(path)
    assert all(e.is_dir() for e in kept)


def test_a_folder_being_written_is_never_removed(tmp_path, cache):
    path = _source(tmp_path)
    entry = cache_entry(path, "weights")
    entry.parent.mkdir(parents=True)
    writing = entry.parent / "tmpab12cd34"  # another process's mkdtemp folder, not yet renamed
    writing.mkdir()
    (writing / "source.json").write_text(json.dumps({"path": str(path.resolve())}))
    os.utime(writing, (0, 0))
    _fill(path)
    assert writing.is_dir()


def test_unlabelled_entries_go_only_when_older_than_the_limit(tmp_path, cache):
    path = _source(tmp_path)
    entry = cache_entry(path, "weights")
    recent, ancient = entry.parent / ("a" * 16), entry.parent / ("b" * 16)
    for d in (recent, ancient):
        d.mkdir(parents=True)
    now = time.time()
    os.utime(ancient, (now - UNLABELLED_MAX_AGE_S - 60,) * 2)
    assert stale_entries(entry, path, now) == [ancient]


def test_a_symlinked_entry_is_not_followed(tmp_path, cache):
    path = _source(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "source.json").write_text(json.dumps({"path": str(path.resolve())}))
    entry = cache_entry(path, "weights")
    entry.parent.mkdir(parents=True)
    (entry.parent / ("c" * 16)).symlink_to(outside)
    _fill(path)
    assert (outside / "source.json").is_file()


def test_a_damaged_label_keeps_the_entry(tmp_path, cache):
    path = _source(tmp_path)
    entry = cache_entry(path, "weights")
    damaged = entry.parent / ("d" * 16)
    damaged.mkdir(parents=True)
    (damaged / "source.json").write_text("{not json")
    assert stale_entries(entry, path) == []


def test_a_failed_write_leaves_no_folder_and_evicts_nothing(tmp_path, cache, caplog):
    path = _source(tmp_path)
    old = _fill(path)
    os.utime(path, (2_000_000_000, 2_000_000_000))

    def fail(tmp):
        raise OSError("disk full")

    fill_cache(cache_entry(path, "weights"), fail, path)
    assert "could not write the cache" in caplog.text
    assert [p.name for p in (cache / "weights").iterdir()] == [old.name]
