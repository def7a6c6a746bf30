"""Helpers for the tests on the real control plane: waiting, reading objects, the audit log."""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e" / "cluster"))

from cluster import Cluster  # noqa: E402

CHART = REPO / "charts" / "slipstream"
EXAMPLES = REPO / "examples"
OPERATOR_NAMESPACE = "slipstream-system"
RELEASE = "slipstream"


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """Polls ``check()`` until it returns something truthy (returned) or ``timeout`` seconds
    pass (AssertionError naming ``what`` and the last value or error)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as err:  # noqa: BLE001 - reported if it persists
            last = err
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


def get(cluster: Cluster, *args: str) -> Any:
    """``kubectl get ARGS -o json`` as a dict (``None`` when it does not exist)."""
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        if "NotFound" in proc.stderr:
            return None
        raise AssertionError(proc.stderr)
    return json.loads(proc.stdout)


def condition(obj: dict | None, type_: str) -> dict | None:
    """The condition of ``type_`` in ``obj['status']['conditions']``, if any."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return c
    return None


def now() -> datetime:
    return datetime.now(timezone.utc)


def forbidden_calls(cluster: Cluster, user: str, since: datetime | None = None) -> list[str]:
    """Requests by ``user`` (received after ``since``) that the API server answered 403, from
    its audit log."""
    out = []
    log = cluster.plane.audit_log
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if (event.get("user", {}).get("username") != user
                or event.get("responseStatus", {}).get("code") != 403):
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if since is None or received >= since:
            out.append(f"{event.get('verb')} {event.get('requestURI')}")
    return out
