"""SIGTERM and SIGHUP end a test session the way Ctrl-C does, so that its teardown runs.

The test cluster's processes (etcd, kube-apiserver, the kubelet and its pods) and the servers
some tests start run in sessions of their own, so that they can be stopped as a group; a pytest
killed outright by a CI timeout or a closed terminal would leave them running. Raised as
KeyboardInterrupt, the signal unwinds the running test and pytest tears every fixture down
(``pytest_sessionfinish``) before it exits with status 2.

A pytest plugin (``tests/conftest.py`` registers it): code under test may take the signals over
and give them back as SIG_DFL (kopf's operator, asyncio's ``remove_signal_handler``), so the
handlers are installed again before and after every test.
"""
from __future__ import annotations

import signal
import threading

import pytest

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def interrupt(signum: int, frame: object) -> None:
    # A second signal during the teardown is let pass: stopping the cluster takes seconds, and a
    # caller that cannot wait has SIGKILL. (Not SIG_IGN: the processes the teardown starts would
    # inherit it.)
    for sig in SIGNALS:
        signal.signal(sig, _ignore)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}: stopping after teardown")


def _ignore(signum: int, frame: object) -> None:
    pass


def interrupt_on_termination() -> None:
    """Install :func:`interrupt` for :data:`SIGNALS` unless a signal already came (then
    :func:`_ignore` stays); only the main thread may (elsewhere: nothing)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            if signal.getsignal(sig) is not _ignore:
                signal.signal(sig, interrupt)


def pytest_configure(config: pytest.Config) -> None:
    interrupt_on_termination()


def pytest_runtest_setup(item: pytest.Item) -> None:
    interrupt_on_termination()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    interrupt_on_termination()  # after the test's fixtures: a session's last test may have reset them
