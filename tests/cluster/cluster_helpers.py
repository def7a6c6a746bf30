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


def install_chart(cluster: Cluster, *args: str) -> None:
    """``helm upgrade --install`` of the chart (README's install, idempotent), waiting for the
    operator; on failure the release is removed, so that later tests start clean, and helm's
    own error is raised (its --timeout is shorter than the subprocess's)."""
    cluster.installed_at = now()
    try:
        cluster.helm("upgrade", "--install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE,
                     "--create-namespace", "--wait", "--timeout", "4m", *args)
    except BaseException:
        cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)
        raise


def uninstall_chart(cluster: Cluster) -> None:
    """README's removal: InferenceServices first (while the operator runs), then the release;
    waits until the operator pod is gone."""
    cluster.kubectl("delete", "infsvc", "--all", "-A", "--wait=true", "--timeout=120s", check=False)
    cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)
    wait_for(lambda: not get(cluster, "pods", "-n", OPERATOR_NAMESPACE)["items"], 60,
             "the operator pod gone")


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
        status = event.get("responseStatus", {})
        if event.get("user", {}).get("username") != user or status.get("code") != 403:
            continue
        # Seconds after a CRD is created the OwnerReferencesPermissionEnforcement plugin may not
        # map its kind yet and refuses an owner reference to it; the operator retries. Not RBAC.
        if "cannot find RESTMapping" in status.get("message", ""):
            continue
        received = datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        if since is None or received >= since:
            out.append(f"{event.get('verb')} {event.get('requestURI')}")
    return out
