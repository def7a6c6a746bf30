"""The InferenceService CRD, generated from the spec's models (``make crds``).

``python -m slipstream.api_types.crd [ROOT]`` writes :data:`OUTPUTS` under ROOT (default: the
working directory, the repository's root): ``crds/inferenceservice.yaml`` and the Helm chart's copy.
The same models give the same bytes. The schema is structural, as the API server wants it: a
``type`` on every node (int-or-string fields say so instead), no ``$ref``, unknown fields kept
only where a field declares it (``env[].valueFrom``, ``status.autoscaler``).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from .inference_service import GROUP, KIND, NAME_RULE, PLURAL, VERSION, InferenceServiceSpec
from .schema import object_schema
from .status import InferenceServiceStatus

SHORT_NAMES = ("infsvc",)  # isvc is KServe's
OUTPUTS = ("crds/inferenceservice.yaml", "charts/slipstream/crds/inferenceservice.yaml")
HEADER = """\
# InferenceService: one served model = a Deployment of `slipstream serve` pods (a LeaderWorkerSet of
# pod groups with spec.parallelism.pipeline > 1) + a ClusterIP Service
# (in front of a `slipstream gateway` Deployment while spec.routing.enabled) + a headless Service NAME-pods.
# `kubectl apply -f crds/` then `slipstream operator`; samples in examples/.
# Generated from src/slipstream/api_types by `make crds`; edit the models there, not this file.
"""

READY = '.status.conditions[?(@.type=="Ready")]'
PRINTER_COLUMNS = (
    {"name": "Ready", "type": "string", "jsonPath": f"{READY}.status"},
    {"name": "Reason", "type": "string", "description": "Why (Downloading while a pod fetches its model)",
     "jsonPath": f"{READY}.reason"},
    {"name": "Replicas", "type": "integer", "description": "Replicas that exist (pods; pod groups with parallelism.pipeline > 1)",
     "jsonPath": ".status.replicas"},
    {"name": "Desired", "type": "integer",
     "description": "Replicas asked for (spec.replicas, or the autoscaler's count)",
     "jsonPath": ".status.desiredReplicas"},
    {"name": "Queue", "type": "number", "description": "Requests waiting, summed over the ready pods, last scrape",
     "jsonPath": ".status.queueDepth"},
    {"name": "KV%", "type": "integer", "description": "KV-cache blocks in use, percent, last scrape",
     "jsonPath": ".status.kvCachePercent"},
    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
)


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object (``apiextensions.k8s.io/v1``) as a dict."""
    schema = {
        "type": "object",
        "description": "A model served by slipstream pods behind a ClusterIP Service.",
        "required": ["spec"],
        "x-kubernetes-validations": [NAME_RULE.to_schema()],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": object_schema(InferenceServiceSpec),
            "status": object_schema(InferenceServiceStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": KIND.lower(), "shortNames": list(SHORT_NAMES), "categories": ["slipstream"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    # kubectl scale and foreign HPAs set spec.replicas.
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                "schema": {"openAPIV3Schema": schema},
            }],
        },
    }


# YAML 1.1 (which kubectl's parser speaks) reads these plain words as booleans or null.
_NOT_PLAIN = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~"}
# A plain scalar may not start with an indicator, a digit or a sign (numbers, dates) or a dot
# before a digit (.5); it may not hold ": " or " #" nor end in ":" or a space.
_PLAIN_START = re.compile(r"[A-Za-z_/^(]|\.[A-Za-z]")
# Inside a flow list ([a, b]) the flow indicators end a plain scalar too.
_PLAIN_IN_FLOW = re.compile(r"[A-Za-z_./][-A-Za-z0-9_./]*")


def _plain(value: str, flow: bool) -> bool:
    if value.lower() in _NOT_PLAIN:
        return False
    if flow:
        return bool(_PLAIN_IN_FLOW.fullmatch(value))
    return (bool(_PLAIN_START.match(value)) and "\n" not in value and ": " not in value
            and " #" not in value and not value.endswith((":", " ")))


def _scalar(value: Any, flow: bool = False) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if _plain(value, flow):
            return value
        if "'" not in value and "\n" not in value:
            return f"'{value}'"  # no escapes in single quotes: patterns stay readable
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar
    raise TypeError(f"no YAML form for {value!r}")


def _lines(value: dict[str, Any], indent: int) -> list[str]:
    """Block-style YAML of a mapping: nested mappings and lists of mappings in blocks, lists of
    scalars in flow style (``[a, b]``), two spaces per level."""
    pad, out = " " * indent, []
    for key, item in value.items():
        key = _scalar(key)
        if isinstance(item, dict) and item:
            out += [f"{pad}{key}:", *_lines(item, indent + 2)]
        elif isinstance(item, list) and item and all(isinstance(i, dict) for i in item):
            out.append(f"{pad}{key}:")
            for entry in item:
                body = _lines(entry, indent + 4)
                out += [f"{pad}  - {body[0].lstrip()}", *body[1:]]
        elif isinstance(item, list):
            out.append(f"{pad}{key}: [{', '.join(_scalar(i, flow=True) for i in item)}]")
        elif isinstance(item, dict):
            out.append(f"{pad}{key}: {{}}")
        else:
            out.append(f"{pad}{key}: {_scalar(item)}")
    return out


def render() -> str:
    """The CRD file's text: :data:`HEADER`, then the YAML of :func:`crd`."""
    return HEADER + "\n".join(_lines(crd(), 0)) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write :data:`OUTPUTS` under ``argv[0]`` (default ``.``); print each path written."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print("usage: python -m slipstream.api_types.crd [ROOT]", file=sys.stderr)
        return 2
    root, text = Path(args[0] if args else "."), render()
    for name in OUTPUTS:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
