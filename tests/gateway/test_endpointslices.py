"""Which EndpointSlice endpoints the gateway routes to (pure part; the watch runs on the real
control plane in tests/cluster)."""
from __future__ import annotations

from kubernetes import client

from slipstream.server.gateway.endpointslices import apply_event, ready_urls


def slice_(endpoints: list[dict], ports: list[dict] | None = None) -> dict:
    return {"addressType": "IPv4", "endpoints": endpoints,
            "ports": ports if ports is not None else [{"name": "http", "port": 8000, "protocol": "TCP"}]}


def ep(address: str, ready: bool | None = True, terminating: bool | None = False) -> dict:
    conditions = {k: v for k, v in (("ready", ready), ("terminating", terminating)) if v is not None}
    return {"addresses": [address], "conditions": conditions}


def test_ready_not_terminating_endpoints_become_urls():
    slices = [slice_([ep("10.244.0.7"), ep("10.244.0.8", ready=False), ep("10.244.0.9", terminating=True),
                      ep("10.244.0.10", ready=None, terminating=None)]),  # unset ready means ready
              slice_([ep("10.244.0.7"), ep("fd00::5")])]
    assert ready_urls(slices) == ["http://10.244.0.10:8000", "http://10.244.0.7:8000", "http://[fd00::5]:8000"]


def test_port_by_name_or_given_and_slices_without_a_usable_port_skipped():
    two_ports = [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9090}]
    assert ready_urls([slice_([ep("10.0.0.1")], two_ports)]) == []  # ambiguous without a name
    assert ready_urls([slice_([ep("10.0.0.1")], two_ports)], port_name="metrics") == ["http://10.0.0.1:9090"]
    assert ready_urls([slice_([ep("10.0.0.1")], [])], port=8123) == ["http://10.0.0.1:8123"]
    assert ready_urls([slice_([ep("10.0.0.1")], [])]) == []


def test_client_model_objects_read_like_dicts():
    model = client.V1EndpointSlice(
        address_type="IPv4", ports=[client.DiscoveryV1EndpointPort(name="http", port=8000)],
        endpoints=[client.V1Endpoint(addresses=["10.244.0.3"], conditions=client.V1EndpointConditions(ready=True)),
                   client.V1Endpoint(addresses=["10.244.0.4"],
                                     conditions=client.V1EndpointConditions(ready=True, terminating=True))])
    assert ready_urls([model]) == ["http://10.244.0.3:8000"]


def test_watch_events_update_the_slices_and_a_bookmark_only_moves_the_version():
    from kubernetes.client import V1EndpointSlice, V1ObjectMeta

    slices: dict = {}
    added = V1EndpointSlice(address_type="IPv4", endpoints=[], metadata=V1ObjectMeta(name="s1", resource_version="5"))
    assert apply_event(slices, {"type": "ADDED", "object": added}) == "5" and slices == {"s1": added}
    # what the client yields for a bookmark: the raw dict (this raised AttributeError and relisted)
    bookmark = {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1", "metadata": {"resourceVersion": "9"}}
    assert apply_event(slices, {"type": "BOOKMARK", "object": bookmark}) == "9" and slices == {"s1": added}
    deleted = V1EndpointSlice(address_type="IPv4", endpoints=[], metadata=V1ObjectMeta(name="s1", resource_version="11"))
    assert apply_event(slices, {"type": "DELETED", "object": deleted}) == "11" and slices == {}
