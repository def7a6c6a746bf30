"""``slipstream operator``: run the operator (kopf) or render manifests without a cluster.

    slipstream operator [run] [--namespace NS ... | --all-namespaces] [--liveness URL]
                              [--peering NAME | --standalone] [--priority N]
                              [--lease-namespace NS] [--lease-seconds S]
                              [--peering-lifetime S] [--resync-seconds S]
                              [--cluster-domain D] [--verbose]
    slipstream operator render -f FILE [-n NAMESPACE] [--kube-version MAJOR.MINOR]

``main(argv)`` returns the exit status; ``slipstream`` (server/cli.py) dispatches to it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import sys
from typing import Any, TextIO

import kopf
import yaml

from slipstream.operator.handlers import OperatorConfig, register
from slipstream.operator.lease import DEFAULT_LEASE_SECONDS
from slipstream.operator.render import render_children
from slipstream.operator.resources import API_VERSION, KIND
from slipstream.operator.spec import SpecError
from slipstream.server.cli_types import positive_float, positive_int

DEFAULT_PEERING = "slipstream-operator"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream operator",
        description="Run the InferenceService operator, or render what it would create.")
    commands = parser.add_subparsers(dest="command")

    run = commands.add_parser("run", help="run the operator (the default command)")
    _add_run_arguments(run)
    _add_run_arguments(parser)  # `slipstream operator --namespace x` means `run`

    render = commands.add_parser("render", help="print the Deployment and Service that "
                                                "InferenceService objects in FILE become")
    render.add_argument("-f", "--filename", required=True,
                        help="YAML file with one or more InferenceService documents ('-': stdin)")
    render.add_argument("-n", "--namespace", default=None,
                        help="namespace for objects that name none (default: 'default')")
    render.add_argument("--kube-version", type=_kube_version, default=None, metavar="MAJOR.MINOR",
                        help="the cluster's Kubernetes version, which decides how an oci:// model "
                             "image is mounted (default: a current one, with image volumes)")
    return parser


def _namespace(text: str) -> str:
    """A namespace name (an RFC 1123 label: lower-case letters, digits and '-', at most 63)."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", text):
        raise argparse.ArgumentTypeError(f"must be a namespace name (RFC 1123 label), got {text!r}")
    return text


def _kube_version(text: str) -> tuple[int, int]:
    try:
        major, minor = text.removeprefix("v").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR such as 1.34, got {text!r}") from None


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", dest="namespaces", default=[],
                       metavar="NS", help="serve this namespace (repeatable; globs allowed)")
    scope.add_argument("-A", "--all-namespaces", action="store_true",
                       help="serve every namespace (cluster-wide)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    peering = parser.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", default=DEFAULT_PEERING,
                         help="kopf peering object for leader election between replicas "
                              f"(default: {DEFAULT_PEERING}; its CRDs are in crds/)")
    peering.add_argument("--standalone", action="store_true",
                         help="no peering: for a single replica, or without the peering CRDs")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; the highest live one acts, the others wait "
                             "(default: random, so two replicas never tie)")
    parser.add_argument("--lease-namespace", type=_namespace, default=None, metavar="NS",
                        help="namespace of the write fence's Lease (named like the peering "
                             "object; default: $POD_NAMESPACE, else the first --namespace, "
                             "else default); only the replica holding it writes")
    parser.add_argument("--lease-seconds", type=positive_int, default=DEFAULT_LEASE_SECONDS,
                        help="the Lease's duration: how long a replica that stopped renewing "
                             f"keeps others from writing (default: {DEFAULT_LEASE_SECONDS})")
    parser.add_argument("--peering-lifetime", type=positive_int, default=60,
                        help="seconds a silent peer counts as alive in kopf peering "
                             "(default: 60)")
    parser.add_argument("--resync-seconds", type=positive_float, default=60.0,
                        help="period of the level-based check of every InferenceService")
    parser.add_argument("--cluster-domain", default="cluster.local",
                        help="cluster DNS domain, for status.url")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def render_documents(documents: list[Any], namespace: str | None = None,
                     kube_version: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """The children of every InferenceService in ``documents`` (others are skipped).
    Raises SpecError naming the object that cannot be served."""
    out: list[dict[str, Any]] = []
    for doc in documents:
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        if doc.get("apiVersion") != API_VERSION:
            raise SpecError("InvalidSpec", f"{KIND} must have apiVersion {API_VERSION}, "
                                           f"got {doc.get('apiVersion')!r}")
        meta = doc.setdefault("metadata", {})
        if namespace or not meta.get("namespace"):
            meta["namespace"] = namespace or "default"
        try:
            out.extend(render_children(doc, kube_version))
        except SpecError as exc:
            raise SpecError(exc.reason, f"{KIND} {meta.get('name')}: {exc.message}") from None
    return out


def render(path: str, namespace: str | None, out: TextIO,
           kube_version: tuple[int, int] | None = None) -> int:
    try:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
        with stream:
            documents = list(yaml.safe_load_all(stream))
        children = render_documents(documents, namespace, kube_version)
    except (OSError, yaml.YAMLError) as exc:
        print(f"slipstream operator render: cannot read {path}: {exc}", file=sys.stderr)
        return 1
    except SpecError as exc:
        print(f"slipstream operator render: {exc.reason}: {exc.message}", file=sys.stderr)
        return 1
    if not children:
        print(f"slipstream operator render: no {KIND} in {path}", file=sys.stderr)
        return 1
    try:
        yaml.safe_dump_all(children, out, sort_keys=False, explicit_start=True)
        out.flush()
    except BrokenPipeError:  # `… | head`: the reader has gone; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    return 0


def operator_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``kopf.operator`` for parsed ``run`` arguments: a registry
    with our handlers, the namespaces (none: cluster-wide), peering and liveness."""
    registry = kopf.OperatorRegistry()
    literal = [ns for ns in args.namespaces if not any(c in ns for c in "*?[!")]
    lease_namespace = None if args.standalone else (
        args.lease_namespace or os.environ.get("POD_NAMESPACE") or (literal or ["default"])[0])
    register(registry, OperatorConfig(resync_seconds=args.resync_seconds,
                                      cluster_domain=args.cluster_domain,
                                      namespaces=tuple(args.namespaces),
                                      lease_namespace=lease_namespace,
                                      lease_seconds=args.lease_seconds,
                                      peering_lifetime=args.peering_lifetime))
    clusterwide = args.all_namespaces or not args.namespaces
    return {
        "registry": registry,
        "clusterwide": clusterwide,
        "namespaces": [] if clusterwide else list(args.namespaces),
        "standalone": args.standalone,
        "peering_name": None if args.standalone else args.peering,
        "priority": args.priority if args.priority is not None else random.randint(1, 2 ** 30),
        "liveness_endpoint": args.liveness,
    }


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(kopf.operator(**operator_arguments(args)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``slipstream operator``; returns the process exit status."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "render":
        return render(args.filename, args.namespace, sys.stdout, args.kube_version)
    return run(args)
