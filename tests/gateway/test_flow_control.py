"""Flow control in the gateway's wait queue: while every pod is full, slots go to critical before
standard requests, between tenants to the least served (VTC, the engine's counters), in arrival
order within a tenant; a sheddable request never waits; a full queue makes room for a critical
request by refusing the newest standard one. And the same through HTTP (429 ``shed``, 400 for a
bad criticality)."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from slipstream.api_types.load import PodLoad
from slipstream.api_types.tenancy import CRITICALITY_HEADER, FAIRNESS_ID_HEADER, tenant_of
from slipstream.server.gateway.config import GatewayConfig
from slipstream.server.gateway.endpoints import EndpointSet
from slipstream.server.gateway.routing import Router
from slipstream.server.gateway.routing.plugins import Choice, RouteRequest
from slipstream.server.gateway.wait_queue import QueueFull, Shed, WaitQueue

from gateway_helpers import chat, metrics, running_gateway, total

POD = "http://127.0.0.2:8000"
POD_NAMES = [f"http://127.0.0.{2 + i}:8000" for i in range(2)]


def one_slot_pod(max_queue: int = 100, weights=None) -> tuple[EndpointSet, WaitQueue]:
    endpoints = EndpointSet(GatewayConfig(max_in_flight=1, max_queue=max_queue))
    endpoints.set_endpoints([POD])
    endpoints.observe(POD, PodLoad(POD, 0.0, 0.0, 0.0, 0.0), ready=True)
    return endpoints, WaitQueue(endpoints, tenant_weights=weights)


ROUTER = Router("least-loaded")


def pick(loads):
    return ROUTER.pick(RouteRequest(), loads)


async def served_order(endpoints: EndpointSet, queue: WaitQueue, waiters: dict[str, asyncio.Task],
                       output_tokens: dict[str, int] | None = None) -> list[str]:
    """Release the slot one request at a time; the order the waiters got it in (by name)."""
    order = []
    while len(order) < len(waiters):
        endpoints.release(POD)
        for _ in range(20):  # the granted waiter's task resumes within a few loop turns
            done = [name for name, task in waiters.items() if task.done() and name not in order]
            if done:
                break
            await asyncio.sleep(0)
        assert len(done) == 1, done
        order += done
        tenant = done[0].split("-")[0]
        queue.charge_output(tenant, (output_tokens or {}).get(tenant, 0))
    return order


async def test_a_flooding_tenant_does_not_starve_one_that_sends_a_few():
    endpoints, queue = one_slot_pod()
    deadline = endpoints.clock() + 30
    await queue.acquire(pick, deadline, tenant="a", prompt_tokens=100)  # a holds the slot
    waiters = {f"a-{i}": asyncio.create_task(queue.acquire(pick, deadline, tenant="a", prompt_tokens=100))
               for i in range(6)}
    await asyncio.sleep(0)
    waiters |= {f"b-{i}": asyncio.create_task(queue.acquire(pick, deadline, tenant="b", prompt_tokens=100))
                for i in range(2)}
    await asyncio.sleep(0)
    assert queue.waiting_by_tenant() == {"a": 6, "b": 2}
    order = await served_order(endpoints, queue, waiters)
    # b's two requests go out within its first turns, not behind a's six (first-come's order):
    # b is lifted to a's count on arrival and, with fewer waiting, wins the tie.
    assert order[:4] == ["b-0", "a-0", "b-1", "a-1"], order


async def test_output_tokens_count_and_weights_scale_the_share():
    endpoints, queue = one_slot_pod(weights={"a": 3})
    deadline = endpoints.clock() + 30
    await queue.acquire(pick, deadline, tenant="x")
    waiters = {f"{t}-{i}": asyncio.create_task(queue.acquire(pick, deadline, tenant=t, prompt_tokens=10))
               for i in range(4) for t in ("a", "b")}
    await asyncio.sleep(0)
    order = await served_order(endpoints, queue, waiters, output_tokens={"a": 100, "b": 100})
    # Each request costs 10 + 2 × 100 tokens; a weighs 3, so a's counter grows a third as fast:
    # three of its requests per one of b's while both wait (ties go to the tenant with fewer waiting).
    assert order == ["a-0", "b-0", "a-1", "a-2", "a-3", "b-1", "b-2", "b-3"], order


async def test_critical_requests_get_the_next_slot_and_sheddable_ones_never_wait():
    endpoints, queue = one_slot_pod()
    deadline = endpoints.clock() + 30
    await queue.acquire(pick, deadline)
    standard = asyncio.create_task(queue.acquire(pick, deadline, tenant="a"))
    await asyncio.sleep(0)
    critical = asyncio.create_task(queue.acquire(pick, deadline, tenant="b", criticality="critical"))
    await asyncio.sleep(0)
    with pytest.raises(Shed):
        await queue.acquire(pick, deadline, criticality="sheddable")
    assert await served_order(endpoints, queue, {"b-critical": critical, "a-standard": standard}) == \
        ["b-critical", "a-standard"]
    endpoints.release(POD)  # a free slot: a sheddable request is served like any other
    assert (await queue.acquire(pick, deadline, criticality="sheddable")).endpoint == POD
    with pytest.raises(ValueError, match="criticality must be one of critical, standard, sheddable"):
        await queue.acquire(pick, deadline, criticality="urgent")


async def test_a_full_queue_refuses_standard_requests_and_makes_room_for_a_critical_one():
    endpoints, queue = one_slot_pod(max_queue=2)
    deadline = endpoints.clock() + 30
    await queue.acquire(pick, deadline)
    first, newest = (asyncio.create_task(queue.acquire(pick, deadline)) for _ in range(2))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await queue.acquire(pick, deadline)
    critical = asyncio.create_task(queue.acquire(pick, deadline, criticality="critical"))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await newest  # the newest standard request gave its place
    assert queue.waiting == 2 and not first.done()
    assert await served_order(endpoints, queue, {"c": critical, "s": first}) == ["c", "s"]


@pytest.mark.timeout(60)
async def test_through_http_a_sheddable_request_gets_429_shed_and_a_bad_criticality_400():
    async with running_gateway(endpoints=(), queue_timeout=5, retry_after=3) as (url, gateway), \
            aiohttp.ClientSession() as session:
        headers = {CRITICALITY_HEADER: "sheddable", FAIRNESS_ID_HEADER: "batch"}
        async with session.post(url + "/v1/chat/completions", json=chat(), headers=headers) as response:
            body = await response.json()
            assert response.status == 429 and response.headers["Retry-After"] == "3", body
            assert body["error"]["code"] == "shed" and body["error"]["type"] == "rate_limit_error"
        async with session.post(url + "/v1/chat/completions", json=chat(),
                                headers={CRITICALITY_HEADER: "urgent"}) as response:
            assert response.status == 400 and "critical, standard, sheddable" in (await response.text())
        assert gateway.queue.waiting == 0
        assert total(await metrics(session, url), "slipstream:gateway_rejections_total", reason="shed") == 1


def pods(slots: int, count: int = 1, weights=None, fair: bool = True) -> tuple[EndpointSet, WaitQueue]:
    names = [f"http://127.0.0.{2 + i}:8000" for i in range(count)]
    endpoints = EndpointSet(GatewayConfig(max_in_flight=slots))
    endpoints.set_endpoints(names)
    for name in names:
        endpoints.observe(name, PodLoad(name, 0.0, 0.0, 0.0, 0.0), ready=True)
    return endpoints, WaitQueue(endpoints, tenant_weights=weights, fair=fair)


async def turns(n: int = 5) -> None:
    """A few loop turns: a granted waiter's task resumes within them."""
    for _ in range(n):
        await asyncio.sleep(0)


async def hold(queue: WaitQueue, tenant: str, n: int, **kwargs) -> list[asyncio.Task]:
    """``n`` acquisitions by ``tenant``, each a task (granted ones are done after a loop turn)."""
    tasks = [asyncio.create_task(queue.acquire(pick, queue.endpoints.clock() + 30, tenant=tenant, **kwargs))
             for _ in range(n)]
    await turns()
    return tasks


async def test_a_tenant_below_its_share_is_not_held_behind_a_flood_of_another():
    endpoints, queue = pods(slots=2, count=2)  # 4 slots
    flood = await hold(queue, "a", 7)
    assert sum(t.done() for t in flood) == 4 and queue.waiting == 3
    few = await hold(queue, "b", 3)
    # b's share of the 4 slots is 2: two go out at once past the pods' limits, spread over both;
    # the third waits like a's.
    granted = [t.result().endpoint for t in few if t.done()]
    assert sorted(granted) == sorted(POD_NAMES[:2]) and queue.waiting_by_tenant() == {"a": 3, "b": 1}
    assert queue.in_flight_by_tenant() == {"a": 4, "b": 2}
    assert sorted(e.in_flight for e in endpoints.loads()) == [3, 3]
    # The pods stay above their limits until a's requests finish: a slot a gives back frees none,
    # and b, at its share, borrows no more; one of b's own returning lets its third go.
    queue.release(flood[0].result().endpoint, "a")
    await turns()
    assert not few[2].done() and queue.in_flight_by_tenant() == {"a": 3, "b": 2}
    queue.release(few[0].result().endpoint, "b")
    await turns()
    assert few[2].done() and queue.waiting_by_tenant() == {"a": 3}
    # a's waiters get slots only as the total falls below the pods' limits (4).
    for task in flood[1:4]:
        queue.release(task.result().endpoint, "a")
    await turns()
    assert sum(t.done() for t in flood[4:]) == 2 and queue.in_flight_by_tenant() == {"a": 2, "b": 2}
    for task in flood[4:]:
        task.cancel()


async def test_weights_size_the_shares_and_one_tenant_or_first_come_never_borrows():
    endpoints, queue = pods(slots=4, weights={"a": 3})  # b's share of 4 slots beside a is 1
    await hold(queue, "a", 4)
    assert [t.done() for t in await hold(queue, "b", 2)] == [True, False]
    for fair, second in ((True, "a"), (False, "b")):  # alone, or first-come: nobody borrows
        endpoints, queue = pods(slots=2, fair=fair)
        await hold(queue, "a", 2)
        assert [t.done() for t in await hold(queue, second, 1)] == [False]


def first_free(loads):
    """Route to the first endpoint (by name) with room: pins a test's requests to one pod."""
    free = sorted((e for e in loads if not e.full), key=lambda e: e.name)
    return Choice(free[0].name, "first") if free else None


async def test_a_tenant_below_its_share_on_one_pod_borrows_there_though_at_its_share_overall():
    # Each engine splits its own seats by weight among the tenants it holds: a tenant absent from a
    # pod leaves that pod's seats to the others, so shares hold per pod, not only in total.
    endpoints, queue = pods(slots=4, count=2, weights={"a": 3})  # b's share: 1 of each pod's 4
    b = [asyncio.create_task(queue.acquire(first_free, endpoints.clock() + 30, tenant="b")) for _ in range(2)]
    [asyncio.create_task(queue.acquire(first_free, endpoints.clock() + 30, tenant="a")) for _ in range(6)]
    await turns()
    assert [t.result().endpoint for t in b] == [POD_NAMES[0]] * 2  # b: 2 of the 8 slots, its share overall
    assert sorted(e.in_flight for e in endpoints.loads()) == [4, 4]
    third = await hold(queue, "b", 1)
    assert third[0].result().endpoint == POD_NAMES[1]  # none of b's on the second pod: it borrows there
    assert [e.in_flight for e in sorted(endpoints.loads(), key=lambda e: e.name)] == [4, 5]
    fourth = await hold(queue, "b", 1)  # at its share on both pods now: it waits
    assert not fourth[0].done() and queue.waiting_by_tenant() == {"b": 1}
    # a, at 6 of 8 overall but 2 of 4 on the first pod (its share 3), borrows there.
    assert (await hold(queue, "a", 1))[0].result().endpoint == POD_NAMES[0]
    fourth[0].cancel()


async def test_the_gateway_sends_a_pod_no_more_than_its_max_waiting_queues():
    endpoints = EndpointSet(GatewayConfig())  # default limit: max_num_seqs + max_num_seqs
    endpoints.set_endpoints([POD])
    endpoints.observe(POD, PodLoad(POD, 0.0, 0.0, 0.0, 0.0, max_num_seqs=4, max_waiting=1), ready=True)
    queue = WaitQueue(endpoints)
    (load,) = endpoints.loads()
    assert (load.capacity, load.accepts) == (5, 5)  # not 8: the pod would answer the rest 429
    await hold(queue, "a", 5)
    assert queue.waiting == 0
    b = await hold(queue, "b", 1)  # below its share, but borrowing stops at what the pod accepts
    assert not b[0].done() and queue.waiting == 1
    b[0].cancel()


async def test_a_sheddable_request_never_borrows():
    endpoints, queue = pods(slots=2)
    await hold(queue, "a", 2)
    with pytest.raises(Shed):
        await queue.acquire(pick, endpoints.clock() + 30, tenant="b", criticality="sheddable")


async def test_per_tenant_metrics_name_the_top_tenants_and_sum_the_rest_as_other():
    from slipstream.api_types import metrics as names
    from slipstream.api_types.metrics import parse_exposition
    from slipstream.api_types.tenancy import TOP_TENANTS
    from slipstream.server.gateway.metrics import GatewayMetrics

    endpoints, queue = one_slot_pod()
    for i in range(TOP_TENANTS + 5):
        queue.service.charge(f"t{i:02d}", 100 + i, 0)
    await queue.acquire(pick, endpoints.clock() + 30, tenant="t24")
    for tenant in ("t23", "t00"):
        with pytest.raises(Shed):
            await queue.acquire(pick, endpoints.clock() + 30, tenant=tenant, criticality="sheddable")
    samples = parse_exposition(GatewayMetrics(endpoints, queue).render().decode())

    def by_tenant(name: str) -> dict[str, float]:
        return {labels["tenant"]: value for labels, value in samples[name]}
    served = by_tenant(names.GATEWAY_TENANT_SERVED_TOKENS)
    assert len(served) == TOP_TENANTS + 1 and "t24" in served and "t00" not in served
    assert served["other"] == sum(100 + i for i in range(5))
    assert by_tenant(names.GATEWAY_TENANT_REQUESTS_IN_FLIGHT)["t24"] == 1
    rejected = by_tenant(names.GATEWAY_TENANT_REJECTIONS)
    assert rejected["t23"] == 1 and rejected["other"] == 1 and rejected["t24"] == 0


def test_counters_of_idle_tenants_are_forgotten_past_the_bound_keeping_the_backlogged():
    from slipstream.server.virtual_token_counter import TokenCounters

    counters = TokenCounters(max_tenants=3)
    for tenant, tokens in (("a", 10), ("b", 50), ("c", 70), ("busy", 40)):
        counters.charge(tenant, tokens, 0)
    counters.lift("new", backlogged=["busy"])  # a (10 ≤ busy's 40) would be lifted anyway
    assert set(counters.counters) == {"c", "busy", "new"} and counters.served("new") == 40


async def test_first_come_between_tenants_when_the_policy_is_not_fair():
    endpoints, _ = one_slot_pod()
    queue = WaitQueue(endpoints, fair=False)
    deadline = endpoints.clock() + 30
    await queue.acquire(pick, deadline, tenant="a")
    waiters = {f"a-{i}": asyncio.create_task(queue.acquire(pick, deadline, tenant="a")) for i in range(3)}
    await asyncio.sleep(0)
    waiters |= {"b-0": asyncio.create_task(queue.acquire(pick, deadline, tenant="b"))}
    await asyncio.sleep(0)
    assert await served_order(endpoints, queue, waiters) == ["a-0", "a-1", "a-2", "b-0"]


async def test_uncongested_tenants_cannot_grow_the_gateways_counters():
    endpoints, queue = one_slot_pod()
    queue.service.max_tenants = 100
    for i in range(1000):
        await queue.acquire(pick, endpoints.clock() + 30, tenant=f"id-{i}", prompt_tokens=10)
        queue.release(POD, f"id-{i}")
    assert len(queue.service.counters) <= 101 and queue.in_flight_by_tenant() == {}


@pytest.mark.timeout(60)
async def test_a_tenant_header_with_bad_bytes_keeps_the_metrics_scrapable():
    async with running_gateway(endpoints=(), queue_timeout=0.2) as (url, gateway), \
            aiohttp.ClientSession() as session:
        raw = "caf\udce9"  # what the server hands over for the byte 0xE9
        gateway.queue.service.charge(tenant_of(raw), 5, 0)
        async with session.get(url + "/metrics") as response:
            assert response.status == 200
            assert 'tenant="caf\ufffd"' in await response.text()
        async with session.post(url + "/v1/chat/completions", json=chat(),
                                headers={FAIRNESS_ID_HEADER: "x" * 300}) as response:
            assert response.status == 400 and "at most 253" in await response.text()
