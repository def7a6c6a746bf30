"""The CPU budget comes from the cgroup quota and the affinity mask, not the node's core count.

Fake cgroup trees in tmp_path stand in for /sys/fs/cgroup."""
from __future__ import annotations

import logging

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
