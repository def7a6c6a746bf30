"""A fetch's progress: a bar on a terminal, log lines in a pod."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("slipstream.sources")


def progress_bar(name: str, total: int, initial: int = 0):
    """A terminal progress bar over one file's ``total`` bytes (``initial`` of them already there:
    a resumed download), updated with ``update(nbytes)`` and closed by ``close()``; disabled when
    stderr is not a terminal, where :class:`Progress`'s log lines report instead."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=name, unit="B", unit_scale=True, unit_divisor=1024,
                disable=not sys.stderr.isatty(), leave=False)


PROGRESS_INTERVAL_S = 10.0  # between progress lines in a fetch's log


class Progress:
    """Logs bytes arrived under ``cache_dir`` every ``interval`` seconds while a fetch runs (pod logs
    get lines, not a progress bar)."""

    def __init__(self, what: str, cache_dir: Path, interval: float | None = None):
        self.what, self.cache_dir = what, cache_dir
        self.interval = PROGRESS_INTERVAL_S if interval is None else interval
        self.stop = threading.Event()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.interval):
            arrived = _bytes_under(self.cache_dir) - self.base
            log.info("fetching %s: %.1f MB so far (%.1f MB/s)", self.what, arrived / 1e6,
                     arrived / 1e6 / (time.monotonic() - t0))

    def __enter__(self):
        self.base = _bytes_under(self.cache_dir)
        self.thread = threading.Thread(target=self._run, name="fetch progress", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                continue
    return total
