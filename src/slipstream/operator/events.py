"""Kubernetes Events on an InferenceService, posted by the operator itself.

``kubectl describe infsvc`` shows them with ``From: slipstream-operator`` (``source.component``;
kopf's own poster says ``kopf`` unless told otherwise, and needs kopf's context, which the
autoscaler's tests do not have). Events help but never fail a reconcile: a refused post is
logged and dropped.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any, Mapping

from slipstream.operator.kube import EVENTS, FIELD_MANAGER, ApiError, Kube

logger = logging.getLogger(__name__)

COMPONENT = FIELD_MANAGER
MAX_MESSAGE = 1024  # the API server's limit on an Event's message


def reporting_instance() -> str:
    """This operator process: its pod's name (the chart sets POD_NAME), else the host name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def render_event(body: Mapping[str, Any], type_: str, reason: str, message: str,
                 now: datetime.datetime) -> dict[str, Any]:
    """A core/v1 Event about ``body`` (``type_`` Normal or Warning; ``reason`` a CamelCase
    word; ``message`` cut to the server's 1024 characters)."""
    meta = body["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 1] + "…"
    stamp = now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta.get("uid")},
        "type": type_,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "reportingInstance": reporting_instance(),
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post_event(kube: Kube, body: Mapping[str, Any], type_: str, reason: str,
                     message: str) -> None:
    """Post :func:`render_event` for ``body``; logs instead of raising when refused."""
    event = render_event(body, type_, reason, message, datetime.datetime.now(datetime.timezone.utc))
    logger.info("%s %s %s/%s: %s", type_, reason, event["metadata"]["namespace"],
                body["metadata"]["name"], event["message"])
    try:
        await kube.create(EVENTS, event)
    except ApiError as exc:
        logger.warning("could not post the %s Event %s: %s", type_, reason, exc)
