"""A node of a group over several machines that is not node 0: ``slipstream serve --nnodes M
--node-rank R --master-addr HOST --master-port P`` (vLLM's names) on R ≥ 1 runs the node's
ranks as worker processes and nothing else: node 0 schedules and serves the API. In
Kubernetes each node is a pod of a LeaderWorkerSet group (the leader is node 0, its address
``LWS_LEADER_ADDRESS``, the pod's index ``LWS_WORKER_INDEX`` its node rank).

The process answers ``GET /health`` (200 while every rank lives) and ``GET /ready`` (503: it
serves no requests) and exits when a rank exits: 0 when node 0 stopped them all, 1 otherwise
(node 0 gone, a rank failed), so the kubelet restarts the pod and the LeaderWorkerSet recreates
the group.
"""
from __future__ import annotations

import asyncio
import logging
import signal

import torch
from aiohttp import web

from ..engine.config import EngineConfig
from ..engine.engine import resolve_device
from ..engine.threads import choose_threads, cpu_limit
from .executor import check_split, start_workers, threads_per_rank

log = logging.getLogger("slipstream.engine")


def node_ranks(config: EngineConfig, node_rank: int) -> range:
    """The global ranks node ``node_rank`` runs: ``ranks_per_node`` consecutive ones.

    Raises:
        ValueError: ``node_rank`` outside ``0 .. nnodes - 1``.
    """
    if not 0 <= node_rank < config.nnodes:
        raise ValueError(f"node rank {node_rank} is not in 0..{config.nnodes - 1}")
    per_node = config.ranks_per_node
    return range(node_rank * per_node, (node_rank + 1) * per_node)


async def run_node(config: EngineConfig, node_rank: int, host: str, port: int) -> int:
    """Start this node's ranks, serve the probes on ``host:port`` and wait; returns the exit code.

    Raises:
        ModelLoadError: the model does not split as configured (:func:`~.executor.check_split`).
    """
    device, dtype = resolve_device(config)
    threads, _ = choose_threads(config.num_threads, torch.get_num_threads(), cpu_limit())
    if config.num_threads is None:
        threads = threads_per_rank(threads, config.ranks_per_node)
    ranks = node_ranks(config, node_rank)
    check_split(config)
    workers = start_workers(config, ranks, config.master_addr, config.master_port, device, dtype, threads)
    log.info("node %d of %d: ranks %d..%d (pids %s), joining %s:%d", node_rank, config.nnodes, ranks[0], ranks[-1],
             ", ".join(str(p.pid) for p in workers), config.master_addr, config.master_port)

    def alive() -> bool:
        return all(p.is_alive() for p in workers)

    app = web.Application()
    app.router.add_get("/health", lambda _: web.json_response({"status": "ok"} if alive() else
                                                              {"status": "a rank exited"}, status=200 if alive() else 503))
    app.router.add_get("/ready", lambda _: web.json_response(
        {"status": "worker node: node 0 serves requests"}, status=503))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    while alive() and not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass
    for p in workers:
        if p.is_alive():
            p.terminate()
        p.join(timeout=10)
    await runner.cleanup()
    codes = [p.exitcode for p in workers]
    log.info("node %d: ranks exited with %s", node_rank, codes)
    return 0 if stop.is_set() or all(c == 0 for c in codes) else 1
