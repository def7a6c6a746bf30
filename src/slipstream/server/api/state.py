"""What the HTTP layer knows about the process: the engine (once loaded), readiness, draining, and
the API calls in flight, which bound the queue (``--max-waiting``) and let a drain wait for them."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from slipstream.api_types.tenancy import DEFAULT_TENANT
from slipstream.server.api.errors import APIError
from slipstream.server.api.logprobs import TokenBytes
from slipstream.server.api.reasoning import get_reasoning_parser
from slipstream.server.api.tools import get_parser, template_supports_tools
from slipstream.server.metrics import RequestRecord, ServerMetrics

logger = logging.getLogger("slipstream.server")


@dataclass
class ServerOptions:
    """HTTP-side settings of ``slipstream serve`` (the engine's are in ``EngineConfig``).

    max_waiting: most requests queued (beyond what the engine can run at once) before 429.
    max_request_bytes: largest request body accepted (413 above it).
    shutdown_timeout: seconds a drain waits for in-flight requests before aborting them.
    log_interval: seconds between two periodic status lines (0: none).
    tool_call_parser: the format tool calls are taught in and read back (``hermes``,
        ``llama3_json``, ``mistral``; see ``slipstream.server.api.tools``).
    reasoning_parser: the format the model's reasoning is split off in (``qwen3``,
        ``deepseek_r1``; see ``slipstream.server.api.reasoning``); None: no reasoning split.
    step_timeout: seconds one engine step may run before ``/ready`` answers 503 (``stalled``),
        so load balancers stop sending requests to a replica whose step hangs; 0: never.
    """

    served_model_names: tuple[str, ...] = ()
    max_waiting: int = 128
    api_key: str | None = None
    vllm_compatible_metrics: bool = False
    max_request_bytes: int = 8 << 20
    shutdown_timeout: float = 30.0
    log_interval: float = 10.0
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    step_timeout: float = 120.0


class ServerState:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.created = int(time.time())
        self.llm: Any = None
        self.ready = False
        self.draining = False
        self.drain_expired = False  # the drain ran out of time and aborted what was left
        self.model_names = options.served_model_names or ("",)  # what clients may pass as ``model``
        self.tool_parser = get_parser(options.tool_call_parser)  # an unknown name fails at start-up
        self.reasoning_parser = (get_reasoning_parser(options.reasoning_parser)
                                 if options.reasoning_parser is not None else None)
        self.template_supports_tools = False
        self.in_flight: dict[str, int] = {}  # API call id -> its sequences (prompts × n)
        self._idle = asyncio.Event()
        self._idle.set()
        self.metrics = ServerMetrics(lambda: self.model_name, self.stats, options.vllm_compatible_metrics,
                                     options.max_waiting)

    @property
    def model_name(self) -> str:
        """The name responses, logs and metrics give: the first served name."""
        return self.model_names[0]

    def attach(self, llm: Any) -> None:
        """Adopt a loaded engine: its name (unless overridden), tokenizer and step listener."""
        self.llm = llm
        self.model_names = self.options.served_model_names or (llm.model_name,)
        self.template_supports_tools = template_supports_tools(llm.tokenizer)
        llm.add_step_listener(self.metrics.on_step)
        self.metrics.start()
        self.token_bytes = TokenBytes(llm.tokenizer)

    def stats(self) -> Any:
        return self.llm.stats() if self.llm is not None else None

    def stalled_for(self) -> float | None:
        """Seconds the engine's step in progress has run when past ``step_timeout``, else None."""
        if not self.options.step_timeout or self.llm is None or not hasattr(self.llm, "step_seconds"):
            return None
        seconds = self.llm.step_seconds()
        return seconds if seconds > self.options.step_timeout else None

    def check_accepting(self) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down and accepts no new requests; retry on another "
                           "replica.", code="server_shutting_down", headers={"Retry-After": "1"})
        if not self.ready:
            raise APIError(503, "The model is still loading; retry when GET /ready returns 200.",
                           code="model_loading", headers={"Retry-After": "5"})

    def would_wait(self, num_seqs: int) -> int:
        """Sequences that would wait for a batch slot once ``num_seqs`` more arrive (prompts × n):
        the engine's queue plus the new ones beyond its free slots, or what would be in flight
        beyond its batch, whichever is larger."""
        stats = self.stats()
        max_num_seqs = self.llm.config.max_num_seqs
        in_flight = sum(self.in_flight.values()) + num_seqs
        running, waiting = (stats.num_running, stats.num_waiting) if stats else (0, 0)
        free = max(0, max_num_seqs - running) if waiting == 0 else 0  # FCFS: none overtakes the queue
        return max(waiting + max(0, num_seqs - free), in_flight - max_num_seqs)

    @contextmanager
    def admit(self, request_id: str, num_prompts: int, n: int = 1,
              tenant: str = DEFAULT_TENANT) -> Iterator[RequestRecord]:
        """Count one API call of ``num_prompts`` prompts × ``n`` choices in flight (429 when the
        queue is full, counted for ``tenant``; 400 when it could never fit); log its line when it
        leaves."""
        self.check_accepting()
        num_seqs = num_prompts * n
        limit = self.llm.config.max_num_seqs + self.options.max_waiting
        if num_seqs > limit:  # would be refused forever, not "retry shortly"
            asked = f"{num_prompts} prompts × n={n}" if n > 1 else f"{num_prompts} prompts"
            raise APIError(400, f"The request asks for {num_seqs} sequences ({asked}); at most {limit} "
                           "(--max-num-seqs plus --max-waiting) can be queued at once. Split it into smaller "
                           "requests.", param="n" if n > 1 else "prompt", code="too_many_sequences")
        if self.would_wait(num_seqs) > self.options.max_waiting:
            self.metrics.reject(tenant)
            raise APIError(429, f"Too many requests queued (limit --max-waiting={self.options.max_waiting}); "
                           "retry shortly.", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.in_flight[request_id] = num_seqs
        self._idle.clear()
        record = RequestRecord(self.metrics, request_id)
        try:
            yield record
        except (asyncio.CancelledError, ConnectionError):  # the client went away (handler cancelled)
            record.client_gone = True
            raise
        finally:
            del self.in_flight[request_id]
            if not self.in_flight:
                self._idle.set()
            if record.client_gone:  # counted once per abandoned call, with the engine's reason
                record.metrics.label(record.metrics.request_success, "abort").inc()
            if record.prompt_tokens or record.client_gone:  # a call refused before it started logs as an error
                logger.info("%s", record.log_line())

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, wait up to ``timeout`` seconds for in-flight calls, abort the rest.

        Returns True when every call finished on its own.
        """
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            # Stopping the engine ends every open stream with an abort, which the handlers answer as 503.
            self.drain_expired = True
            await self.llm.shutdown()
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except asyncio.TimeoutError:
                logger.warning("%d requests still in flight after abort", len(self.in_flight))
            return False


STATE = web.AppKey("state", ServerState)
