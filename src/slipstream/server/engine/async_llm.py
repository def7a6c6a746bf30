"""AsyncLLM: the engine stepping in a background thread, each request an async stream of increments.

The step loop owns the engine; the event loop only hands it commands (add, abort) through a
thread-safe queue and receives increments via ``call_soon_threadsafe``. So a long forward pass
never blocks HTTP handling, and an abort is applied before the next step: its blocks are free
within one step.

KV events take the same road: while a listener is registered the KV cache records them, and
after each step the engine thread hands that step's events to the loop as one numbered
:class:`KVEventBatch`. A :meth:`AsyncLLM.kv_snapshot` is taken on the engine thread between two
steps, so it holds exactly the blocks of every batch up to its ``seq``.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from slipstream.api_types.tenancy import DEFAULT_TENANT

from ..distributed.executor import RankFailed
from ..weights.errors import ModelLoadError
from .config import EngineConfig
from .engine import LLMEngine
from .errors import RequestRejected
from .kv_cache import KVEvent
from .outputs import CompletionOutput, FinishReason, RequestOutput
from .sampling_params import SamplingParams
from .trace import EngineStats, StepRecord

log = logging.getLogger("slipstream.engine")

__all__ = ["AsyncLLM", "KVEventBatch", "KVSnapshot", "RequestRejected"]


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One step's KV events. seq: 1, 2, 3, … per engine, without gaps."""

    seq: int
    events: list[KVEvent]


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """Every shareable block's hash, after the batches up to ``seq`` (0: before the first).
    block_size: tokens per block."""

    seq: int
    block_size: int
    block_hashes: list[bytes]


class AsyncLLM:
    """Args:
        config: engine settings. The model loads in the constructor (seconds).
        engine: an already built engine (tests, the simulator); ``config`` is then ignored.
    """

    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Set when the engine cannot run another step (a tensor-parallel rank died): the server exits.
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self._kv_listeners: list[Callable[[KVEventBatch], None]] = []  # called on the loop
        self._kv_seq = 0  # engine thread: the last batch handed out
        self._step_started: float | None = None  # engine thread writes, the loop reads (/ready)

    def step_seconds(self) -> float:
        """Seconds the step in progress has run (0.0 between steps): a step that never ends (a
        tensor-parallel rank stopped but not dead, a kernel that hangs) shows here long before a
        collective's timeout."""
        started = self._step_started
        return 0.0 if started is None else time.monotonic() - started

    # --- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step loop on a daemon thread (idempotent)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        self._thread.start()

    async def warmup(self) -> None:
        """Run one tiny request through a step, so the first real request pays no first-call costs.

        Raises:
            ModelLoadError: the step failed (a model whose every output is NaN, say): a server
                that cannot answer one token must not report ready.
        """
        async for out in self.generate([self.engine.eos_token_ids[0] if self.engine.eos_token_ids else 0],
                                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                                       request_id="warmup"):
            if out.error:
                raise ModelLoadError(f"the model failed its warm-up step: {out.error}")

    async def shutdown(self) -> None:
        """Stop the step loop; unfinished requests are aborted."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        self.engine.close()
        for rid, q in list(self._streams.items()):  # ended by the step loop's last abort, or never added
            if q.empty():
                q.put_nowait(RequestOutput(rid, [], [CompletionOutput(0, "", [], FinishReason.ABORT.value)], True,
                                           error="server shutting down"))
        while True:  # commands the step loop will never apply: snapshots nobody will take
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "kv_snapshot" and not arg.done():
                arg.set_exception(RuntimeError("engine is not running"))

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, tenant: str = DEFAULT_TENANT,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's increments (new text and token ids per choice) until it finishes.
        ``tenant`` and ``priority`` (lower runs sooner): what the scheduling policy orders by.

        Raises (on the first iteration, before anything is queued):
            RequestRejected: the request can never fit (``.code == "context_length_exceeded"``).
            ValueError: bad prompt or parameters.
            RuntimeError: the engine is shutting down.

        Closing or cancelling the iterator early aborts the request.
        """
        if self._thread is None or self._stopping:
            raise RuntimeError("engine is not running")
        # Tokenizing a long prompt and compiling a grammar take a while: off the event loop and the step
        # loop both (the request is queued only once its grammar is built).
        reqs = await asyncio.to_thread(self.engine.make_requests, prompt, params, request_id,
                                       tenant=tenant, priority=priority)
        rid = reqs[0].group_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream
        self._commands.put(("add", reqs))
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._commands.put(("abort", rid))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """:meth:`abort` without awaiting: safe in cleanup code that may be cancelled."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def check_token_ids(self, ids: list, param: str = "prompt") -> None:
        """:meth:`LLMEngine.check_token_ids` (pure: safe from the event loop)."""
        self.engine.check_token_ids(ids, param)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def add_step_listener(self, fn: Callable[[StepRecord], None]) -> None:
        """Call ``fn(record)`` on the engine thread after every step."""
        self.engine.step_listeners.append(fn)

    # --- KV events (loop side) --------------------------------------------------------------
    def add_kv_event_listener(self, fn: Callable[[KVEventBatch], None]) -> None:
        """Call ``fn(batch)`` on the event loop with every step's KV events from now on; the
        cache records events only while some listener is registered."""
        self._kv_listeners.append(fn)
        if len(self._kv_listeners) == 1:
            self._command("kv_events", True)

    def remove_kv_event_listener(self, fn: Callable[[KVEventBatch], None]) -> None:
        """Stop calling ``fn`` (a listener not registered is ignored)."""
        if fn in self._kv_listeners:
            self._kv_listeners.remove(fn)
            if not self._kv_listeners:
                self._command("kv_events", False)

    async def kv_snapshot(self) -> KVSnapshot:
        """The hashes of every block the KV cache can share now, taken between two steps.

        Batches with ``seq`` up to the snapshot's were delivered to listeners before it returns.
        Raises RuntimeError when the engine is not running."""
        if self._thread is None or self._stopping:
            raise RuntimeError("engine is not running")
        assert self._loop is not None
        future = self._loop.create_future()
        self._command("kv_snapshot", future)
        return await future

    def _command(self, kind: str, arg) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    def _publish_kv(self, batch: KVEventBatch) -> None:
        for fn in list(self._kv_listeners):
            fn(batch)

    # --- the step loop (engine thread) ------------------------------------------------------
    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add(arg)
                except ValueError as e:
                    self._deliver_error(arg[0].group_id, str(e))
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "kv_events":
                self.engine.kv.record_events(arg)
            else:  # kv_snapshot: after the batches already recorded
                self._flush_kv_events()
                kv = self.engine.kv
                snapshot = KVSnapshot(self._kv_seq, kv.block_size, kv.cached_hashes())
                self._loop.call_soon_threadsafe(_resolve, arg, snapshot)

    def _flush_kv_events(self) -> None:
        events = self.engine.kv.take_events()
        if events:
            self._kv_seq += 1
            self._loop.call_soon_threadsafe(self._publish_kv, KVEventBatch(self._kv_seq, events))

    def _run(self) -> None:
        engine = self.engine
        engine.apply_threads()  # torch's thread setting does not follow a new thread
        while not self._stopping:
            self._apply_commands()
            try:
                if not engine.has_unfinished():
                    engine.check_ranks()  # a rank that dies while idle fails the server now
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._step_started = time.monotonic()
                try:
                    outputs = engine.step()
                finally:
                    self._step_started = None
            except RankFailed as e:  # no later step can run: fail everything and stop
                log.error("%s: the engine stops", e)
                self.failure, self._stopping = e, True
                self._abort_all(f"engine failed: {e}")
                self._flush_kv_events()
                self._loop.call_soon_threadsafe(self.failed.set)
                break
            except Exception as e:  # a scheduler bug must not hang every client
                log.exception("engine step crashed; failing all requests")
                self._abort_all(f"internal engine error: {type(e).__name__}: {e}")
                self._flush_kv_events()
                continue
            for out in outputs:
                self._deliver(out)
            self._flush_kv_events()
        self._apply_commands()  # requests added meanwhile end with the others
        self._abort_all("server shutting down")

    def _abort_all(self, error: str) -> None:
        """Fail every request in the engine (the engine finishes them) and deliver their last outputs."""
        for rid in list(self.engine.groups):
            self._deliver(self.engine.abort(rid, error))

    def _deliver(self, out: RequestOutput) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put, out)

    def _put(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)

    def _deliver_error(self, rid: str, message: str) -> None:
        """End the stream of a request the engine never took (refused on add, or left at shutdown)."""
        self._deliver(RequestOutput(rid, [], [CompletionOutput(0, "", [], FinishReason.ABORT.value)], True,
                                    error=message))


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # the caller may have given up (cancelled) meanwhile
        future.set_result(value)
