"""The gateway in front of real sim pods on small versions of the routing workload: prefix-aware
routing sends every request of a prefix group to the pod that holds the group's system prompt
(asserted on routing decisions and the pods' own prefix-cache counters, not on times), and a
rolling update under load, done as the Deployment controller does it, fails no request."""
from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from gateway_helpers import API_KEY, AUTH, MODEL, metrics, running_gateway, start_pods, total
from slipstream.server.kv_hash import prompt_block_hashes
from slipstream.server.sim.workloads import PrefixGroups, Turn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
SUCCESS = "slipstream:request_success_total"
HITS = "slipstream:prefix_cache_hits_total"
# 4 groups, each a 160-token system prompt (10 full blocks of 16), 16-token user turns.
WORKLOAD = PrefixGroups(groups=4, prefix_tokens=160, turn_tokens=16, turns=3, output_tokens=2, think_time=0)
SEED = 7


async def complete(session: aiohttp.ClientSession, url: str, turn: Turn, max_tokens: int = 2,
                   stream: bool = False) -> tuple[int, int]:
    """(HTTP status, completion tokens) of one token-id completion; a stream counts its text
    chunks and fails on an in-band error event."""
    body = {"model": MODEL, "prompt": turn.prompt_ids(), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "user": turn.session_key, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as response:
        if not stream or response.status != 200:
            data = await response.json()
            return response.status, (data.get("usage") or {}).get("completion_tokens", 0)
        chunks = 0
        async for raw in response.content:
            line = raw.decode().strip()
            assert '"error"' not in line, f"in-band error: {line}"
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                chunks += 1
        return response.status, chunks


async def served_and_hits(session: aiohttp.ClientSession, urls: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    samples = {u: await metrics(session, u) for u in urls}
    return {u: (total(s, SUCCESS), total(s, HITS)) for u, s in samples.items()}


@pytest.mark.parametrize("policy", ["kv-events", "prefix"])
async def test_prefix_routing_sends_every_request_of_a_group_to_the_pod_that_holds_its_prefix(pods, policy):
    urls = (pods["a"].url, pods["b"].url)
    async with running_gateway(endpoints=urls, policy=policy, api_key=API_KEY) as (url, gateway), \
            aiohttp.ClientSession(headers=AUTH) as session:
        home: dict[int, str] = {}
        for group in range(WORKLOAD.groups):
            # The group's first request: its system prompt is cached on whichever pod took it.
            before = await served_and_hits(session, urls)
            status, _ = await complete(session, url, Turn(WORKLOAD, SEED, group, 1000 + group, 0))
            assert status == 200
            after = await served_and_hits(session, urls)
            (home[group],) = [u for u in urls if after[u][0] == before[u][0] + 1]
            if policy == "kv-events":  # the pod's stored-block events reach the gateway's index
                prefix = Turn(WORKLOAD, SEED, group, 1000 + group, 0).prompt_ids()[:WORKLOAD.prefix_tokens]
                hashes = prompt_block_hashes(prefix, 16)
                deadline = time.monotonic() + 5
                while gateway.block_index.match(hashes).get(home[group], 0) < len(hashes):
                    assert time.monotonic() < deadline, "the pod's KV events never reached the index"
                    await asyncio.sleep(0.02)
        assert set(home.values()) == set(urls), f"every group on one pod: {home}"

        start = await metrics(session, url)
        for group in range(WORKLOAD.groups):
            before = await served_and_hits(session, urls)
            # New sessions of the group (not the warm-up's): only the system prompt is shared.
            results = [await complete(session, url, Turn(WORKLOAD, SEED, group, 2000 + 10 * group + k, 0))
                       for k in range(3)]
            assert [status for status, _ in results] == [200] * 3
            after = await served_and_hits(session, urls)
            served = {u: after[u][0] - before[u][0] for u in urls}
            assert served[home[group]] == 3, f"group {group} went to {served}, its prefix is on {home[group]}"
            # Each of the three found the 10 blocks of its system prompt in the pod's cache.
            assert after[home[group]][1] - before[home[group]][1] >= 3 * WORKLOAD.prefix_tokens
        samples = await metrics(session, url)
        hits = "slipstream:gateway_routing_decisions_total"
        assert total(samples, hits, policy=policy, reason="prefix-hit") \
            - total(start, hits, policy=policy, reason="prefix-hit") == 3 * WORKLOAD.groups


async def test_a_rolling_update_under_load_fails_no_request():
    """maxSurge 1, maxUnavailable 0, as the operator renders it: for each old pod, a new one starts
    and turns ready and joins the EndpointSlice, then the old one gets SIGTERM (it drains: its
    in-flight requests finish, new ones get 503) and leaves the slice a moment later, as the
    EndpointSlice controller sees it (the gateway, reading the pods' load once a second, may learn
    of the drain first from the pod's KV-event stream ending; a draining pod's 503 before the
    first byte would be retried elsewhere). Streams and whole answers keep coming all the while."""
    old = start_pods({"old-1": "127.0.0.51", "old-2": "127.0.0.52"})
    new: dict = {}
    try:
        live = [old["old-1"].url, old["old-2"].url]
        async with running_gateway(endpoints=tuple(live), policy="kv-events", scrape_interval=1.0,
                                   api_key=API_KEY) \
                as (url, gateway), aiohttp.ClientSession(headers=AUTH) as session:
            outcomes: list[tuple[int, int, int]] = []  # (status, tokens, tokens asked)
            stop = asyncio.Event()

            async def client(worker: int) -> None:
                k = 0
                while not stop.is_set():
                    stream, asked = k % 2 == 0, 30 if k % 3 else 6
                    turn = Turn(WORKLOAD, SEED, worker % WORKLOAD.groups, 5000 + 100 * worker + k, 0)
                    status, tokens = await complete(session, url, turn, max_tokens=asked, stream=stream)
                    outcomes.append((status, tokens, asked))
                    k += 1

            clients = [asyncio.create_task(client(w)) for w in range(6)]
            await asyncio.sleep(1.0)
            for i, (name, address) in enumerate((("new-1", "127.0.0.53"), ("new-2", "127.0.0.54"))):
                new.update(await asyncio.to_thread(start_pods, {name: address}))
                live.append(new[name].url)
                gateway.endpoints.set_endpoints(live)          # ready: it joins the slice
                await asyncio.sleep(0.5)
                leaving = old[f"old-{i + 1}"]
                leaving.process.send_signal(signal.SIGTERM)    # the kubelet stops it ...
                await asyncio.sleep(1.0)                       # ... and the slice hears of it later
                live.remove(leaving.url)
                gateway.endpoints.set_endpoints(live)
                assert await asyncio.to_thread(leaving.process.wait, 30) == 0  # drained, not killed
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 60)

            assert len(outcomes) > 30
            failed = [o for o in outcomes if o[0] != 200 or o[1] != o[2]]
            assert not failed, f"{len(failed)} of {len(outcomes)} failed or short, e.g. {failed[:3]}"
            samples = await metrics(session, url)
            assert total(samples, "slipstream:gateway_upstream_errors_after_first_byte_total") == 0
            # the new pods took the load after the update
            served = {u: total(await metrics(session, u), SUCCESS) for u in live}
            assert all(n > 0 for n in served.values()), served
    finally:
        for pod in (*old.values(), *new.values()):
            pod.kill()
