"""The CPU budget comes from the cgroup quota and the affinity mask, not the node's core count.

Fake cgroup trees in tmp_path stand in for /sys/fs/cgroup."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from slipstream.server.engine import threads
from slipstream.server.engine.threads import cgroup_cpus, choose_threads, cpu_limit


def _v2(tmp_path, text: str):
    (tmp_path / "cpu.max").write_text(text)
    return tmp_path


def _v1(tmp_path, quota: str, period: str = "100000", controller: str = "cpu"):
    d = tmp_path / controller
    d.mkdir()
    (d / "cpu.cfs_quota_us").write_text(quota + "\n")
    (d / "cpu.cfs_period_us").write_text(period + "\n")
    return tmp_path


def test_cgroup_v2_quota_of_two_cpus(tmp_path):
    assert cgroup_cpus(_v2(tmp_path, "200000 100000\n")) == 2


def test_cgroup_v2_max_is_no_limit(tmp_path):
    assert cgroup_cpus(_v2(tmp_path, "max 100000\n")) is None


@pytest.mark.parametrize("text, cpus", [("150000 100000", 2), ("50000 100000", 1), ("1000 100000", 1)])
def test_fractional_quota_rounds_up_to_at_least_one(tmp_path, text, cpus):
    assert cgroup_cpus(_v2(tmp_path, text)) == cpus


def test_cgroup_v1_quota_over_period(tmp_path):
    assert cgroup_cpus(_v1(tmp_path, "400000")) == 4


def test_cgroup_v1_under_the_joint_cpu_cpuacct_controller(tmp_path):
    assert cgroup_cpus(_v1(tmp_path, "300000", controller="cpu,cpuacct")) == 3


def test_cgroup_v1_quota_minus_one_is_no_limit(tmp_path):
    assert cgroup_cpus(_v1(tmp_path, "-1")) is None


def test_no_cgroup_files_is_no_limit(tmp_path):
    assert cgroup_cpus(tmp_path) is None
    assert cgroup_cpus(tmp_path / "does-not-exist") is None


@pytest.mark.parametrize("text", ["", "garbage", "200000", "max"])
def test_malformed_cpu_max_is_no_limit(tmp_path, text):
    assert cgroup_cpus(_v2(tmp_path, text)) is None


def test_unreadable_cpu_max_falls_back_to_v1(tmp_path):
    (tmp_path / "cpu.max").mkdir()  # reading a directory raises IsADirectoryError
    assert cgroup_cpus(_v1(tmp_path, "200000")) == 2


def test_limit_is_the_smaller_of_quota_and_affinity(tmp_path, monkeypatch):
    root = _v2(tmp_path, "800000 100000")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert cpu_limit(root) == 3
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert cpu_limit(root) == 8


def test_limit_without_quota_is_the_affinity_mask(tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert cpu_limit(tmp_path) == 2


def test_limit_unknown_without_quota_or_affinity(tmp_path, monkeypatch):
    monkeypatch.delattr(threads.os, "sched_getaffinity", raising=False)
    assert cpu_limit(tmp_path) is None


def test_configured_threads_win():
    assert choose_threads(4, 64, 2)[0] == 4


def test_torch_default_is_capped_at_the_limit():
    n, why = choose_threads(None, 64, 2)
    assert n == 2 and "2" in why and "64" in why


def test_torch_default_kept_under_the_limit_or_without_one():
    assert choose_threads(None, 4, 16)[0] == 4
    assert choose_threads(None, 4, None)[0] == 4


def test_engine_applies_the_cpu_limit_and_logs_it_once(make_llm, monkeypatch, caplog):
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # another test may have left this process at 1: the limit must be lower
    monkeypatch.setattr(threads, "cgroup_cpus", lambda root="/sys/fs/cgroup": 1)
    caplog.set_level(logging.INFO, logger="slipstream.engine")
    try:
        engine = make_llm().engine
        assert torch.get_num_threads() == 1
        engine.apply_threads()  # as the async engine's step thread does
        assert torch.get_num_threads() == 1
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch threads")]
        assert len(logged) == 1 and logged[0].startswith("torch threads: 1 (the CPU limit")
    finally:
        torch.set_num_threads(before)


_TEAM_SCRIPT = r"""
import concurrent.futures, json, os, torch
torch.set_num_threads(2)
from slipstream.server.engine import engine as engine_mod
from slipstream.server.engine.config import EngineConfig

def tasks():
    return len(os.listdir("/proc/self/task"))

loader = concurrent.futures.ThreadPoolExecutor(1)  # like the server's: it outlives the load
loader.submit(tasks).result()
seen = {"base": tasks()}
loader.submit(lambda: torch.ones(1 << 22).add_(1)).result()  # a parallel region: a team of 2
seen["with_team"] = tasks()
seen["released"] = loader.submit(engine_mod.release_openmp_team).result()
seen["after_release"] = tasks()
loader.submit(lambda: torch.ones(1 << 22).add_(1)).result()
seen["team_again"] = tasks()
engine = loader.submit(engine_mod.LLMEngine, EngineConfig(num_threads=2, kv_cache_memory_bytes=1 << 24)).result()
seen["after_engine"] = tasks()
loader.submit(engine_mod.release_openmp_team).result()  # nothing left to give back
seen["engine_then_release"] = tasks()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_thread_done_with_torch_gives_its_openmp_workers_back():
    """A team left on the loading thread makes libgomp stop spinning at the stepping thread's
    barriers (threads.release_openmp_team): the engine gives its loading team back."""
    done = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["with_team"] == seen["base"] + 1  # one worker beside the submitting thread
    assert seen["released"] is True
    assert seen["after_release"] == seen["base"]
    assert seen["team_again"] == seen["base"] + 1  # the next region builds a new team
    # LLMEngine gave back the team its load built (it may start threads of its own).
    assert seen["engine_then_release"] == seen["after_engine"]
