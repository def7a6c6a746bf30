"""Rank 0 of a parallel engine (``tensor × pipeline`` ranks on this machine): starts the other
ranks as worker processes (multiprocessing ``spawn``; no torchrun), loads its own slice of the
model, and runs every step as a :class:`~slipstream.server.engine.model_runner.StepRunner` whose
inputs it first broadcasts, so that every rank runs its part of the same step (vLLM's
multiprocessing executor has the same shape: one scheduler, step inputs broadcast to every rank).

A rank that dies fails the next collective on rank 0 at once ("connection closed by peer",
"connection reset"); rank 0 then raises :class:`RankFailed` naming the rank and, when it could
say, why. Any error in the middle of a step is fatal the same way: the ranks may be left in
different collectives, so no later step could line up. While idle, :meth:`ParallelRunner.check_ranks`
notices a rank that died between requests (a process of this machine at once; another node's
ranks by a ping every few seconds).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import time

import torch

from ..engine.config import EngineConfig
from ..engine.memory import plan_kv_cache
from ..engine.model_runner import PromptSpan, StepOutput, chunk_logprobs, logits_chunks
from ..engine.scheduler import SchedulerOutput
from ..engine.step_inputs import HostStep, layout
from ..models.loader import ModelLoadError, read_model_config
from ..models.pipeline_parallel import stage_layers
from ..models.tensor_parallel import check_tensor_parallel
from .group import free_port
from .pipeline import receive_outputs, run_stage
from .worker import ERROR_KEY, WorkerSpec, block_bytes, join, run_worker

log = logging.getLogger("slipstream.engine")

HOST = "127.0.0.1"  # every rank of a single-machine group
PING_INTERVAL_S = 5.0  # idle: how often rank 0 checks that another node's ranks still answer
DEATH_GRACE_S = 2.0  # after a failed step: how long to wait for the ranks' exits, to name them


class RankFailed(RuntimeError):
    """A rank of a parallel engine died or failed; the engine cannot run another step."""


def threads_per_rank(num_threads: int, size: int) -> int:
    """Each rank's torch threads when ``size`` ranks share ``num_threads`` cores (at least one)."""
    return max(1, num_threads // size)


def check_split(config: EngineConfig) -> None:
    """Check, from the model's config alone and before any process starts, that the model splits
    into ``tensor_parallel_size`` slices (heads, MLP width) and ``pipeline_parallel_size`` stages
    (layers).

    Raises:
        ModelLoadError: it does not (naming the model and the size), or the model cannot be read.
    """
    cfg = read_model_config(config.model)
    try:
        check_tensor_parallel(cfg, config.tensor_parallel_size)
        stage_layers(cfg.num_layers, config.pipeline_parallel_size, 0)
    except ValueError as e:
        raise ModelLoadError(f"{config.model}: {e}") from None


def start_workers(config: EngineConfig, ranks, host: str, port: int, device: torch.device, dtype: torch.dtype,
                  num_threads: int) -> list[multiprocessing.Process]:
    """Start a worker process (multiprocessing ``spawn``) per global rank of ``ranks``, joining the
    store at ``host:port``; on CUDA each takes the GPU of its rank on this node."""
    ctx = multiprocessing.get_context("spawn")
    dtype_name = str(dtype).removeprefix("torch.")
    workers = []
    for rank in ranks:
        rank_device = f"cuda:{rank % config.ranks_per_node}" if device.type == "cuda" else str(device)
        spec = WorkerSpec(config, rank, host, port, rank_device, dtype_name, num_threads, os.getpid())
        proc = ctx.Process(target=run_worker, args=(spec,), name=f"slipstream-rank-{rank}", daemon=True)
        proc.start()
        workers.append(proc)
    return workers


class ParallelRunner:
    """The engine's step runner over ``tensor_parallel_size × pipeline_parallel_size`` ranks;
    rank 0 (stage 0's first tensor rank) is this process.

    Args:
        config: the engine's settings (``model``, the parallel sizes, …), sent to every rank.
        device, dtype: this rank's; on CUDA rank r takes ``cuda:r``.
        num_threads: this rank's torch threads; each worker gets the same.

    Raises:
        ModelLoadError: the model could not be loaded, or cannot be split that way (its heads,
            MLP width or layers; checked before a worker starts).
        RankFailed: a worker failed to start.
    """

    supports_prompt_logprobs = True

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, num_threads: int):
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self.pipeline_size = config.pipeline_parallel_size
        host, port = config.master_addr, config.master_port or free_port(HOST)
        self.groups = None
        self.workers = []
        self.nnodes = config.nnodes
        self._last_ping = time.monotonic()
        check_split(config)
        self.workers = start_workers(config, range(1, config.ranks_per_node), host, port, device, dtype, num_threads)
        log.info("parallel engine: tensor %d × pipeline %d ranks (workers: pids %s), %d threads each",
                 config.tensor_parallel_size, config.pipeline_parallel_size,
                 ", ".join(str(p.pid) for p in self.workers), num_threads)
        try:
            self.groups, self.loaded, self.runner = join(config, 0, host, port, device, dtype,
                                                         check_ranks=self._check_started)
        except Exception:
            self.close()
            raise
        self.block_size = config.block_size
        if self.pipeline_size == 1:
            self.runner.on_step = self._send_step

    def _check_started(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if not p.is_alive()]
        if dead:
            raise RankFailed("parallel engine: " + "; ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} "
                                                             f"before joining (its log says why)" for r, p in dead))

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's slice of the model."""
        return self.runner.model

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.runner.kv_cache

    def check_ranks(self) -> None:
        """Called by the engine while idle. Raises :class:`RankFailed` when a worker of this
        machine has exited or, every :data:`PING_INTERVAL_S` with other nodes, when a ping to
        every rank fails."""
        if not all(p.is_alive() for p in self.workers):
            raise self.failure(None)
        if self.nnodes > 1 and time.monotonic() - self._last_ping >= PING_INTERVAL_S:
            self._last_ping = time.monotonic()
            self._send(("ping",))

    def _send(self, command: tuple) -> None:
        if not all(p.is_alive() for p in self.workers):  # a rank that died between steps: say so now
            raise self.failure(None)
        try:
            self.groups.broadcast_object(command)
        except RuntimeError as e:
            raise self.failure(e) from e

    def _send_step(self, step: HostStep, chunks: list[tuple[int, int]]) -> None:
        self._send(("step", step, chunks))

    def failure(self, cause: BaseException | None) -> RankFailed:
        """A :class:`RankFailed` naming the ranks that died and what they recorded. After a failed
        collective (``cause``) up to :data:`DEATH_GRACE_S` seconds are given for the ranks to
        exit: the one that died may not be reaped yet, and the survivors fail their own
        collectives and exit too, so the message names the rank that died first, not only its
        peers' errors."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while cause is not None and any(p.is_alive() for p in self.workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        why = []
        for rank, proc in enumerate(self.workers, start=1):
            try:
                key = ERROR_KEY.format(rank=rank)
                note = self.groups.store.get(key).decode() if self.groups.store.check([key]) else None
            except Exception:
                note = None
            if note or not proc.is_alive():
                why.append(f"rank {rank} (pid {proc.pid}) " + (f"failed: {note}" if note else
                                                               f"exited with code {proc.exitcode}"))
        return RankFailed("parallel engine: " + ("; ".join(why) or f"a step failed: {type(cause).__name__}: {cause}"))

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Every rank allocates ``num_blocks`` blocks of its own layers and KV heads."""
        self._send(("allocate", num_blocks, max_model_len))
        self.runner.allocate_kv_cache(num_blocks, max_model_len)

    def kv_cache_bytes(self, max_num_batched_tokens: int, utilization: float, block_size: int,
                       max_model_len: int) -> int:
        """CUDA: rank 0's bytes for the fewest KV blocks any rank can hold after profiling its own
        memory (a block's bytes differ between stages of different depths)."""
        self._send(("profile", max_num_batched_tokens, utilization, block_size, max_model_len))
        own = block_bytes(self.runner, block_size)
        plan = plan_kv_cache(self.runner.profile_memory(max_num_batched_tokens), utilization, own, block_size,
                             max_model_len)
        try:
            return self.groups.min_over_ranks(plan.kv_cache_bytes // own) * own
        except RuntimeError as e:
            raise self.failure(e) from e

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> StepOutput:
        return self.run_with_prompt_logprobs(batch, sample_rows, [])

    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int],
                                 spans: list[PromptSpan]) -> StepOutput:
        try:
            if self.pipeline_size == 1:  # rank 0 holds the logits itself
                return self.runner.run_with_prompt_logprobs(batch, sample_rows, spans)
            return self._run_pipeline(batch, sample_rows, spans)
        except RankFailed:
            raise
        except Exception as e:  # a peer went away, or the ranks no longer line up: fatal either way
            raise self.failure(e) from e

    def _run_pipeline(self, batch: SchedulerOutput, sample_rows: list[int], spans: list[PromptSpan]) -> StepOutput:
        step = layout(batch, self.block_size, sample_rows)
        chunks = logits_chunks(step, batch, spans)
        rows = [(c.row0, len(c.targets)) for c in chunks]
        self._send_step(step, rows)
        run_stage(self.groups, self.runner, step, rows)
        non_finite, logits, chunk_logits = receive_outputs(self.groups, step, rows, self.loaded.config.vocab_size,
                                                           self.runner.device)
        computed = [[] for _ in spans]
        for chunk, rows_logits in zip(chunks, chunk_logits):
            computed[chunk.span].extend(chunk_logprobs(rows_logits, chunk.targets, chunk.top_n))
        return StepOutput(logits, computed, non_finite)

    def close(self) -> None:
        """Stop the workers (asked first, then terminated); idempotent."""
        asked = False
        if self.groups is not None and all(p.is_alive() for p in self.workers):
            try:
                self.groups.broadcast_object(("stop",))
                asked = True
            except RuntimeError:
                pass
        for p in self.workers:
            p.join(timeout=5 if asked else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.workers = [p for p in self.workers if p.is_alive()]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the daemon workers are terminated anyway
            pass
