"""The metrics contract: names written once, one reader of Prometheus text for gateway and operator."""
from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.api_types import metrics as names
from slipstream.api_types.load import GatewayLoad, PodLoad
from slipstream.api_types.metrics import read_gateway_load, read_pod_load

POD = """# TYPE slipstream:num_requests_waiting gauge
slipstream:num_requests_waiting{model_name="a"} 2
slipstream:num_requests_waiting{model_name="b"} 3
# TYPE slipstream:num_requests_running gauge
slipstream:num_requests_running{model_name="a"} 4
slipstream:num_requests_running{model_name="b"} 1
# TYPE slipstream:kv_cache_usage_perc gauge
slipstream:kv_cache_usage_perc{model_name="a"} 0.25
slipstream:kv_cache_usage_perc{model_name="b"} 0.5
# TYPE slipstream:engine_config_info gauge
slipstream:engine_config_info{model_name="a",block_size="32",max_num_seqs="64"} 1
"""


def test_a_pod_reading_sums_requests_takes_the_fullest_cache_and_the_engine_settings():
    assert read_pod_load(POD, pod="p", time=2.0) == PodLoad("p", 2.0, 5.0, 5.0, 0.5, 32, 64)
    assert read_pod_load(POD, model_name="b") == PodLoad("", 0.0, 3.0, 1.0, 0.5, None, None)


def test_a_missing_gauge_is_named_and_bad_settings_are_ignored():
    with pytest.raises(ValueError, match="metrics missing: slipstream:kv_cache_usage_perc"):
        read_pod_load(POD.split("# TYPE slipstream:kv_cache_usage_perc")[0])
    odd = POD.replace('block_size="32"', 'block_size="zero"').replace('max_num_seqs="64"', 'max_num_seqs="-1"')
    assert read_pod_load(odd).block_size is None and read_pod_load(odd).max_num_seqs is None


def test_a_gateway_reading_tells_no_endpoint_from_no_in_flight_family():
    waiting = "# TYPE slipstream:gateway_requests_waiting gauge\nslipstream:gateway_requests_waiting 3\n"
    in_flight = ('# TYPE slipstream:gateway_endpoint_in_flight gauge\n'
                 'slipstream:gateway_endpoint_in_flight{endpoint="http://a"} 2\n'
                 'slipstream:gateway_endpoint_in_flight{endpoint="http://b"} 1\n')
    assert read_gateway_load(waiting + in_flight) == GatewayLoad(3.0, 3.0)
    assert read_gateway_load(waiting + "# TYPE slipstream:gateway_endpoint_in_flight gauge\n") == GatewayLoad(3.0, 0.0)
    assert read_gateway_load(waiting) == GatewayLoad(3.0, None)
    with pytest.raises(ValueError, match="metrics missing: slipstream:gateway_requests_waiting"):
        read_gateway_load(in_flight)


def test_the_gateway_and_the_operator_read_with_the_contracts_reader_and_sample_type():
    from slipstream.operator import scraper
    from slipstream.server.gateway import load

    assert scraper.parse_metrics is read_pod_load and scraper.parse_gateway_metrics is read_gateway_load
    assert load.read_pod_load is read_pod_load


def test_every_load_gauge_the_readers_need_is_one_the_server_exports():
    from slipstream.server.engine.trace import EngineStats
    from slipstream.server.metrics import ServerMetrics

    stats = EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.5, num_blocks=100, num_free_blocks=50,
                        num_preemptions_total=0, prefix_cache_queries_total=0, prefix_cache_hits_total=0,
                        prompt_tokens_total=0, generation_tokens_total=0, num_steps=0, block_size=16,
                        max_num_seqs=8, max_num_batched_tokens=256, enable_prefix_caching=True,
                        long_prefill_token_threshold=128)
    text = ServerMetrics(lambda: "m", lambda: stats, vllm_compatible=True).render().decode()
    assert read_pod_load(text) == PodLoad("", 0.0, 1.0, 2.0, 0.5, 16, 8)
    assert 'long_prefill_token_threshold="128"' in text  # every setting of the engine's, as a label
    assert all(f"{vllm} " in text or f"{vllm}{{" in text for vllm in names.VLLM_GAUGES.values())


def test_importing_the_contract_needs_no_prometheus_client():
    code = ("import sys, slipstream.api_types.metrics, slipstream.api_types.load; "
            "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'slipstream.server', "
            "'slipstream.operator'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
