"""Stopping fetches: :func:`cancel_fetches` (``slipstream download`` and ``serve`` call it on
SIGINT/SIGTERM) makes every running fetch raise :class:`Interrupted` at its next check (each 1 MiB
chunk from the Hub or S3, each wait), releasing its lock on the way out."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Interrupted(BaseException):
    """A fetch stopped by :func:`cancel_fetches` (a signal). A BaseException, like
    KeyboardInterrupt, so that no ``except Exception`` on the way (ours, huggingface_hub's,
    botocore's retries) takes it for a network error. ``signum``: the signal, or None;
    ``exit_code``: 128 + ``signum`` (130 for SIGINT, 143 for SIGTERM), else 130."""

    def __init__(self, signum: int | None = None):
        self.signum = signum
        name = signal.Signals(signum).name if signum else "cancelled"
        super().__init__(f"fetch interrupted ({name})")

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)


_cancel = threading.Event()
_cancel_signum: list[int | None] = [None]
_in_flight = [0]
_in_flight_guard = threading.Lock()


def cancel_fetches(signum: int | None = None) -> bool:
    """Make every running and later fetch of this process raise :class:`Interrupted` at its next
    check (each chunk, each wait); for a process that is stopping. ``signum``: the signal that
    asked, for the exit code. Returns whether a fetch was running. Safe from a signal handler."""
    _cancel_signum[0] = signum
    _cancel.set()
    return _in_flight[0] > 0


def cancelled() -> bool:
    """Whether :func:`cancel_fetches` was called (and not yet answered by a KeyboardInterrupt)."""
    return _cancel.is_set()


def check_cancelled() -> None:
    """Raise :class:`Interrupted` if :func:`cancel_fetches` was called (the fetchers' check)."""
    if _cancel.is_set():
        raise Interrupted(_cancel_signum[0])


def sleep(seconds: float) -> None:
    """Wait ``seconds``, or raise :class:`Interrupted` as soon as :func:`cancel_fetches` is called."""
    if _cancel.wait(seconds):
        check_cancelled()


@contextlib.contextmanager
def fetching() -> Iterator[None]:
    """Count a running fetch; on the main thread, while Python's own SIGINT handler is in place, a
    Ctrl-C also stops the download threads (huggingface_hub's pool would otherwise finish every file
    it started before the KeyboardInterrupt got out). Nothing else about signals changes."""
    check_cancelled()
    with _in_flight_guard:
        _in_flight[0] += 1
    wrapped = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if wrapped:
        def on_sigint(signum, frame):
            cancel_fetches(signum)
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        with _in_flight_guard:
            _in_flight[0] -= 1
        if wrapped:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if _cancel.is_set() and _cancel_signum[0] == signal.SIGINT:
                _cancel.clear()  # the KeyboardInterrupt is the caller's now; a later fetch may run
