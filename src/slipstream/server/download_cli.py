"""``slipstream download URI``: fetch a model into the model cache, as an InferenceService's init
container does before ``slipstream serve`` starts.

On success the termination message (``--termination-message-path``, Kubernetes'
``terminationMessagePath``) is ``{"model", "revision", "bytes", "seconds", "path"}`` and the exit
code 0; on failure ``{"model", "error", "reason", "status"}``, the message on stderr, exit code 1.
``--revision-file PATH`` also writes the success JSON there (a pod-local emptyDir), which
``slipstream serve --model-revision-file PATH`` reads to serve exactly that revision.
Network errors (``Unreachable``) and rate limits (``RateLimited``, after a 429's Retry-After) are
tried again a few times with backoff; 401/403/404 and ``ChecksumMismatch`` fail at once.

SIGINT and SIGTERM (a pod being deleted) stop the download within a chunk (1 MiB, from
the Hub or S3): the lock is released so that another process takes over at once, the
termination message says ``"reason": "Interrupted"``, and the exit code is 130 (SIGINT) or 143
(SIGTERM). A second signal exits at once, leaving the lock for the stale-lock takeover.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

TERMINATION_MESSAGE_MAX = 4096  # bytes the kubelet keeps of a termination message


def parser() -> argparse.ArgumentParser:
    from slipstream.server.cli import HelpFormatter, byte_size

    p = argparse.ArgumentParser(prog="slipstream download", formatter_class=HelpFormatter,
                                description="Fetch a model (hf://ORG/NAME[@REVISION][:FILE], ORG/NAME, "
                                            "s3://BUCKET/PREFIX) into the model cache shared by serve.")
    p.add_argument("model", metavar="URI", help="the model to fetch (forms as for `slipstream serve --model`)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the model cache (default: $SLIPSTREAM_MODEL_CACHE, else ~/.cache/slipstream/models)")
    p.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: $AWS_ENDPOINT_URL, else AWS)")
    p.add_argument("--termination-message-path", type=Path, default=None,
                   help="write the result as JSON here (a pod's /dev/termination-log); default: nowhere")
    p.add_argument("--revision-file", type=Path, default=None,
                   help="on success also write the result JSON here, whole (a pod-local file: `slipstream serve "
                        "--model-revision-file` then serves exactly this revision); default: nowhere")
    p.add_argument("--max-cache-bytes", type=byte_size, default=None,
                   help="after fetching, evict least recently used models until the cache holds at most this much "
                        "(e.g. 200GiB); the model just fetched, models being fetched and models a server holds a lease on "
                        "are kept")
    p.add_argument("--offline", action="store_true", help="use the cache only (as HF_HUB_OFFLINE=1)")
    p.add_argument("--retries", type=int, default=3, help="tries again after network errors")
    p.add_argument("--stale-lock-seconds", type=float, default=30.0,
                   help="take over another process's download lock after this long without its heartbeat")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level; HTTP clients' per-request lines only at DEBUG")
    return p


def _write(path: Path | None, doc: dict) -> None:
    if path is None:
        return
    text = json.dumps(doc)  # ASCII: one byte a character
    if len(text) > TERMINATION_MESSAGE_MAX:  # the kubelet would cut it mid-JSON: shorten the message
        excess = len(text) - TERMINATION_MESSAGE_MAX + len("...")
        text = json.dumps({**doc, "error": doc["error"][:-excess] + "..."})
    try:
        path.write_text(text)
    except OSError as e:  # the result still reaches the log
        print(f"slipstream download: cannot write the termination message to {path}: {e}", file=sys.stderr)


def _fail(args, message: str, reason: str, status: int | None) -> int:
    print(f"slipstream download: {message}", file=sys.stderr)
    _write(args.termination_message_path, {"model": args.model, "error": message, "reason": reason, "status": status})
    return 1


def _stop_on_signals() -> None:
    """SIGINT/SIGTERM: cancel the fetch (its download threads stop at their next chunk) and raise
    :class:`~slipstream.server.weights.cancel.Interrupted` here in the main thread, which unwinds through the lock's release;
    a second signal exits at once."""
    from slipstream.server.weights import cancel

    def on_signal(signum, frame):
        if cancel.cancelled():
            os._exit(128 + signum)
        cancel.cancel_fetches(signum)
        raise cancel.Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)


def main(argv: list[str]) -> int:
    from slipstream.server.weights.cache_lock import HEARTBEAT_S

    p = parser()
    args = p.parse_args(argv)
    if args.retries < 0:
        p.error(f"--retries must be >= 0, got {args.retries}")
    if not args.stale_lock_seconds > HEARTBEAT_S:  # the holder rewrites its lock every HEARTBEAT_S
        p.error(f"--stale-lock-seconds must be more than the lock's {HEARTBEAT_S:g} s heartbeat, "
                f"got {args.stale_lock_seconds:g}")
    from slipstream.server.cli import configure_logging

    configure_logging(args.log_level)
    from slipstream.server.weights import fetch
    from slipstream.server.weights.cache import ModelCache
    from slipstream.server.weights.cancel import Interrupted
    from slipstream.server.weights.errors import ModelSourceError
    from slipstream.server.weights.eviction import evict
    from slipstream.server.weights.uri import parse_model_uri

    cache_dir = args.cache_dir or fetch.default_cache_dir()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    if in_main:
        _stop_on_signals()
    try:
        uri = parse_model_uri(args.model)
        # this process does not serve the model: no lease (the lock and `keep` protect it here)
        result = fetch.fetch(uri, cache_dir, offline=args.offline, s3_endpoint=args.s3_endpoint,
                             retries=args.retries, stale_after_s=args.stale_lock_seconds, lease=False)
        if args.max_cache_bytes is not None:
            evict(cache_dir, args.max_cache_bytes, keep=(str(result.path), str(result.path.parent)),
                  cache=ModelCache(cache_dir, stale_after_s=args.stale_lock_seconds))
    except Interrupted as e:
        name = signal.Signals(e.signum).name if e.signum else "a signal"
        _fail(args, f"model {args.model!r}: interrupted by {name}; the download lock is released, so another "
                    "process can take over", "Interrupted", None)
        return e.exit_code
    except ModelSourceError as e:
        return _fail(args, str(e), e.reason, e.status)
    except OSError as e:  # the cache volume: read-only, full, or not ours (hostPath without permissions)
        return _fail(args, f"model {args.model!r}: cannot write the model cache {cache_dir}: {e}",
                     "CacheNotWritable", None)
    except Exception as e:  # a bug: the operator still gets a reason, the log the traceback
        logging.getLogger("slipstream.sources").exception("slipstream download %s failed", args.model)
        return _fail(args, f"model {args.model!r}: unexpected {type(e).__name__}: {e}", "Unexpected", None)
    finally:
        for signum, handler in previous.items():  # main() also runs inside tests' processes
            signal.signal(signum, handler)
    doc = {"model": args.model, "revision": result.revision, "bytes": result.bytes,
           "seconds": round(result.seconds, 3), "path": str(result.path)}
    if args.revision_file is not None:
        from slipstream.server.weights.disk_cache import write_atomic
        try:  # whole or not at all: the server pins its model to it
            write_atomic(args.revision_file, json.dumps(doc))
        except OSError as e:
            return _fail(args, f"model {args.model!r}: cannot write the revision file {args.revision_file}: {e}",
                         "CacheNotWritable", None)
    _write(args.termination_message_path, doc)
    print(f"{args.model}: revision {result.revision}, {result.bytes} bytes in {result.seconds:.1f} s at {result.path}")
    return 0
