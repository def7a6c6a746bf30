"""`slipstream gateway`'s command line and its import boundary."""
from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.server.gateway.cli import config_from_args, gateway_parser
from slipstream.server.gateway.routing import Weights


def parse(*argv: str):
    return config_from_args(gateway_parser().parse_args(list(argv)))


def test_flags_the_operator_renders_are_accepted():
    config = parse("--host", "0.0.0.0", "--port", "8000", "--service", "chat-pods", "--namespace", "team-a",
                   "--target-port-name", "http", "--routing", "prefix", "--weight-prefix", "2",
                   "--weight-queue", "1.5", "--weight-kv-cache", "0", "--weight-affinity", "0.25",
                   "--max-queue", "50", "--queue-timeout", "600")
    assert (config.service, config.namespace, config.target_port_name, config.policy) == \
        ("chat-pods", "team-a", "http", "prefix")
    assert config.weights == Weights(prefix=2.0, queue=1.5, kv_cache=0.0, affinity=0.25)
    assert dict(parse().weights) == {"prefix": 3.0, "queue": 1.0, "kv_cache": 0.5, "affinity": 0.5}
    assert (config.max_queue, config.queue_timeout, config.endpoints) == (50, 600.0, ())


def test_endpoints_and_a_service_are_exclusive_and_urls_are_checked():
    with pytest.raises(ValueError, match="not both"):
        parse("--endpoint", "http://127.0.0.2:8000", "--service", "chat-pods")
    with pytest.raises(ValueError, match="http"):
        parse("--endpoint", "127.0.0.2:8000")
    assert parse("--endpoint", "http://127.0.0.2:8000/", "--endpoint", "http://127.0.0.2:8000").endpoints == \
        ("http://127.0.0.2:8000",)


def test_bad_values_exit_with_usage():
    result = subprocess.run([sys.executable, "-m", "slipstream.server", "gateway", "--routing", "random"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_the_gateway_imports_no_engine_torch_or_api():
    code = ("import sys, slipstream.server.gateway.app, slipstream.server.gateway.cli; "
            "print(','.join(m for m in ('torch', 'slipstream.server.engine', 'slipstream.server.api', "
            "'slipstream.server.models', 'slipstream.operator') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
