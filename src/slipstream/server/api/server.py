"""Run ``slipstream serve``: listen first, load and warm the engine, serve, drain on SIGTERM/SIGINT.

``/health`` answers from the first moment; ``/ready`` only once the model is loaded and one
warm-up step has run. SIGTERM (or SIGINT) starts a drain, which is what lets Kubernetes roll pods
without dropping requests: ``/ready`` turns 503 so the pod leaves the Service, new requests get
503, in-flight ones finish (up to ``--shutdown-timeout``), then the process exits 0. A second
signal exits at once. A signal that comes while the model is still being fetched stops the fetch
at its next chunk (releasing its lock for another process) and exits 130 (SIGINT) or 143 (SIGTERM).
An engine that cannot run another step (a tensor-parallel rank died) fails its requests, turns
``/ready`` 503 and the process exits 1, for the kubelet to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from slipstream.server.api.app import build_app
from slipstream.server.api.state import STATE, ServerOptions, ServerState
from slipstream.server.weights.cancel import cancel_fetches

logger = logging.getLogger("slipstream.server")


def _build_engine(engine_config):
    from slipstream.server.engine.async_llm import AsyncLLM  # heavy (torch, transformers): off the event loop

    if engine_config.model.startswith("sim:"):  # a cost model in place of the forward pass
        from slipstream.server.sim.backend import build_engine
        return AsyncLLM(engine=build_engine(engine_config))
    if engine_config.device == "cpu":
        from slipstream.kernels import cpu_native

        started = time.perf_counter()
        cpu_native.library()  # the path in use logged first; a SLIPSTREAM_CPU_ISA it cannot run fails the start
        logger.info("start phase: kernels %.2f s", time.perf_counter() - started)
    return AsyncLLM(engine_config)


async def _load_engine(state: ServerState, engine_config) -> None:
    started = time.perf_counter()
    llm = await asyncio.get_running_loop().run_in_executor(None, _build_engine, engine_config)
    built = time.perf_counter()
    state.attach(llm)
    await llm.start()
    await llm.warmup()
    state.ready = True
    stats = llm.stats()
    # The start by part (README, "Cold start"): imports, weights and kernels, then warm-up.
    logger.info("start phase: engine build %.2f s (imports, weights, kernels), warm-up %.2f s",
                built - started, time.perf_counter() - built)
    logger.info("model %s ready: max_model_len=%d, %d KV blocks of %d tokens, token budget %d a step%s",
                state.model_name, llm.max_model_len, stats.num_blocks, engine_config.block_size,
                engine_config.max_num_batched_tokens, _long_prefill_note(engine_config))


def _long_prefill_note(config) -> str:
    """The ready line's words on ``--long-prefill-token-threshold``: none when off."""
    threshold = config.long_prefill_token_threshold
    if not threshold:
        return ""
    if threshold >= config.max_num_batched_tokens:
        return (f", long-prefill threshold {threshold} (not below the budget: no chunk is ever capped; "
                f"lower it to take effect)")
    return f", long prompts {threshold} tokens a step beside others"


async def _log_status(state: ServerState, interval: float) -> None:
    """One line every ``interval`` seconds while there is work: queue, batch, KV usage, throughput."""
    last = None
    while True:
        await asyncio.sleep(interval)
        stats = state.stats()
        if stats is None:
            continue
        now = (stats.prompt_tokens_total, stats.generation_tokens_total)
        if last is not None and (now != last or stats.num_running or stats.num_waiting):
            logger.info("running=%d waiting=%d kv_cache_usage=%.1f%% prompt_throughput=%.1f tok/s "
                        "generation_throughput=%.1f tok/s preemptions=%d", stats.num_running, stats.num_waiting,
                        100 * stats.kv_cache_usage, (now[0] - last[0]) / interval, (now[1] - last[1]) / interval,
                        stats.num_preemptions_total)
        last = now


async def serve(engine_config, options: ServerOptions, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT, then drain. Returns the process exit code."""
    app = build_app(options)
    state = app[STATE]
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:  # port in use, address not on this host, ...
        logger.error("cannot listen on %s:%d: %s", host, port, exc.strerror or exc)
        await runner.cleanup()
        return 1
    logger.info("listening on http://%s:%d (model %s)", host, port, engine_config.model)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    interrupted: list[int] = []  # the signal that stopped a model fetch

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        # still loading: a fetch or a first-use kernel build in the loader's thread would otherwise
        # run to its end before exit (the build's module is there only if the loader imported it)
        builds = sys.modules.get("slipstream.kernels.cpu_build")
        if state.llm is None and (cancel_fetches(signum) | bool(builds and builds.cancel_builds())):
            interrupted.append(signum)
        logger.info("%s: draining (up to %.0fs for in-flight requests)", signal.Signals(signum).name,
                    options.shutdown_timeout)
        state.draining = True
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    loader = asyncio.create_task(_load_engine(state, engine_config))
    status = asyncio.create_task(_log_status(state, options.log_interval)) if options.log_interval > 0 else None
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loader.done() and loader.exception() is not None and not interrupted:
        exc = loader.exception()
        if isinstance(exc, ValueError):  # ModelLoadError or a bad setting: the message says which
            logger.error("loading the model failed: %s", exc)
        else:
            logger.error("loading the model failed", exc_info=exc)
        code = 1
    else:
        waits = {stopper}
        if state.llm is not None:
            waits.add(asyncio.create_task(state.llm.failed.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if state.llm is not None and state.llm.failure is not None:
            state.ready, state.draining = False, True
            logger.error("the engine failed (%s): exiting", state.llm.failure)
            code = 1
        elif interrupted and not state.ready:
            logger.error("%s while loading the model: stopped", signal.Signals(interrupted[0]).name)
            code = 128 + interrupted[0]
        elif state.ready:
            finished = await state.drain(options.shutdown_timeout)
            logger.info("drained: %s", "all requests finished" if finished else "aborted the rest at the timeout")
    loader.cancel()
    stopper.cancel()
    if status is not None:
        status.cancel()
    await runner.cleanup()
    if state.llm is not None:
        await state.llm.shutdown()
    logger.info("stopped")
    return code
