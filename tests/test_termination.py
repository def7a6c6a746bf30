"""A test session stopped by SIGTERM tears its fixtures down (tests/termination.py): the
processes a fixture started in their own session (as the test cluster's are) do not outlive it,
also after a test gave the signal back to its default."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import termination

HERE = Path(__file__).resolve().parent

SESSION = '''
import subprocess
from pathlib import Path

import pytest

import termination


def pytest_configure(config):
    config.pluginmanager.register(termination)


@pytest.fixture(scope="session")
def server():
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path("server.pid").write_text(str(proc.pid))
    yield proc
    proc.terminate()
    proc.wait()
    Path("torn-down").write_text("yes")
'''

TEST = '''
import signal
import time
from pathlib import Path


def test_gives_the_signal_back_as_the_default(server):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as kopf or asyncio's remove_signal_handler do


def test_runs_long(server):
    Path("running").write_text("yes")
    time.sleep(120)
'''


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_runs_the_sessions_teardown(tmp_path):
    (tmp_path / "conftest.py").write_text(SESSION)
    (tmp_path / "test_long.py").write_text(TEST)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_long.py"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "running").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.1)
        pid = int((tmp_path / "server.pid").read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    left = alive(pid)
    if left:
        os.kill(pid, signal.SIGKILL)  # what the teardown should have done
    assert proc.returncode == 2, out  # pytest's "interrupted"
    assert (tmp_path / "torn-down").exists() and not left, out
    assert "SIGTERM" in out


def test_this_session_interrupts_on_sigterm(request):
    # tests/conftest.py registered the plugin for every test run
    assert request.config.pluginmanager.is_registered(termination)
    assert signal.getsignal(signal.SIGTERM) is termination.interrupt
    assert signal.getsignal(signal.SIGHUP) is termination.interrupt
