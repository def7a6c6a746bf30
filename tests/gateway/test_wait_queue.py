"""The wait queue apart from the endpoint set: FIFO slots as capacity frees, bounded, deadlines."""
from __future__ import annotations

import asyncio

import pytest

from slipstream.api_types.load import PodLoad
from slipstream.server.gateway.config import GatewayConfig
from slipstream.server.gateway.endpoints import EndpointSet
from slipstream.server.gateway.routing import Router
from slipstream.server.gateway.routing.plugins import RouteRequest
from slipstream.server.gateway.wait_queue import DeadlineExceeded, QueueFull, WaitQueue

POD = "http://127.0.0.2:8000"


def routable_pod(config: GatewayConfig) -> EndpointSet:
    endpoints = EndpointSet(config)
    endpoints.set_endpoints([POD])
    endpoints.observe(POD, PodLoad(POD, 0.0, 0.0, 0.0, 0.0), ready=True)
    return endpoints


async def test_a_released_slot_goes_to_the_first_waiter_and_the_full_queue_refuses_at_once():
    endpoints = routable_pod(GatewayConfig(max_in_flight=1, max_queue=2))
    queue = WaitQueue(endpoints)
    router = Router("least-loaded")
    pick = lambda loads: router.pick(RouteRequest(), loads)  # noqa: E731
    deadline = endpoints.clock() + 30
    assert (await queue.acquire(pick, deadline)).endpoint == POD
    first = asyncio.create_task(queue.acquire(pick, deadline))
    second = asyncio.create_task(queue.acquire(pick, deadline))
    await asyncio.sleep(0)
    assert queue.waiting == 2 and endpoints.get(POD).in_flight == 1
    with pytest.raises(QueueFull):
        await queue.acquire(pick, deadline)
    endpoints.release(POD)  # the endpoint set tells the queue; the oldest waiter gets the slot
    assert queue.waiting == 1 and endpoints.get(POD).in_flight == 1
    assert (await asyncio.wait_for(first, 5)).endpoint == POD and not second.done()
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)
    assert queue.waiting == 0 and endpoints.get(POD).in_flight == 1


async def test_a_waiter_past_its_deadline_gets_deadline_exceeded_and_leaves_the_queue():
    queue = WaitQueue(EndpointSet(GatewayConfig()))
    with pytest.raises(DeadlineExceeded):
        await queue.acquire(lambda loads: None, queue.endpoints.clock() + 0.01)
    assert queue.waiting == 0
