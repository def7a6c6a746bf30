"""Rank 0 of a tensor-parallel engine: starts the other ranks as worker processes on this
machine (multiprocessing ``spawn``; no torchrun), loads its own slice of the model, and runs
every step as a :class:`~slipstream.server.engine.model_runner.StepRunner` whose inputs it first
broadcasts, so that the workers replay the same forward pass (vLLM's multiprocessing executor
has the same shape: one scheduler, step inputs broadcast to every rank).

A rank that dies fails the next collective on rank 0 at once ("connection closed by peer");
rank 0 then raises :class:`RankFailed` naming the rank and, when it could say, why.
"""
from __future__ import annotations

import logging
import multiprocessing

import torch

from ..engine.config import EngineConfig
from ..engine.memory import plan_kv_cache
from ..engine.model_runner import ModelRunner, PromptSpan, StepOutput
from ..engine.scheduler import SchedulerOutput
from ..engine.step_inputs import HostStep
from ..models.loader import LoadedModel, load_model
from .group import TensorParallelGroup, free_port
from .worker import ERROR_KEY, WorkerSpec, run_worker

log = logging.getLogger("slipstream.engine")

HOST = "127.0.0.1"  # every rank of a single-machine group


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot run another step."""


def threads_per_rank(num_threads: int, size: int) -> int:
    """Each rank's torch threads when ``size`` ranks share ``num_threads`` cores (at least one)."""
    return max(1, num_threads // size)


class ParallelRunner:
    """The engine's step runner over ``config.tensor_parallel_size`` ranks; rank 0 is this process.

    Args:
        config: the engine's settings (``model``, ``tensor_parallel_size``, …), sent to every rank.
        device, dtype: this rank's; a worker of rank r on CUDA takes ``cuda:r``.
        num_threads: this rank's torch threads; each worker gets the same.

    Raises:
        ValueError: the model cannot be split that many ways (its heads or MLP width).
        ModelLoadError: the model could not be loaded on rank 0.
        RankFailed: a worker failed to start or to load.
    """

    supports_prompt_logprobs = True

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, num_threads: int):
        self.size = config.tensor_parallel_size
        port = free_port(HOST)
        ctx = multiprocessing.get_context("spawn")
        dtype_name = str(dtype).removeprefix("torch.")
        self.workers = []
        self.group: TensorParallelGroup | None = None
        for rank in range(1, self.size):
            rank_device = f"cuda:{rank}" if device.type == "cuda" else str(device)
            spec = WorkerSpec(config, rank, self.size, HOST, port, rank_device, dtype_name, num_threads)
            proc = ctx.Process(target=run_worker, args=(spec,), name=f"slipstream-tp-rank-{rank}", daemon=True)
            proc.start()
            self.workers.append(proc)
        log.info("tensor parallel: %d ranks (workers: pids %s), %d threads each", self.size,
                 ", ".join(str(p.pid) for p in self.workers), num_threads)
        try:
            self.group = TensorParallelGroup(0, self.size, HOST, port, device, check_ranks=self._check_started)
            self.loaded: LoadedModel = load_model(config.model, device, dtype, config.quantization,
                                                  tensor_parallel=self.group)
        except Exception:
            self.close()
            raise
        self.runner = ModelRunner(self.loaded.model, config.block_size, device, dtype,
                                  max_num_seqs=config.max_num_seqs, graphs=False)
        self.runner.on_step = self._send_step

    def _check_started(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if not p.is_alive()]
        if dead:
            raise RankFailed("tensor parallel: " + "; ".join(f"rank {r} (pid {p.pid}) exited with code {p.exitcode} "
                                                            f"before joining (its log says why)" for r, p in dead))

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.runner.kv_cache

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's slice of the model."""
        return self.runner.model

    def _send(self, command: tuple) -> None:
        try:
            self.group.broadcast_object(command)
        except RuntimeError as e:
            raise self.failure(e) from e

    def _send_step(self, step: HostStep, chunks: list[tuple[int, int]]) -> None:
        self._send(("step", step, chunks))

    def failure(self, cause: BaseException) -> RankFailed:
        """A :class:`RankFailed` naming the ranks that died and what they recorded."""
        why = []
        for rank, proc in enumerate(self.workers, start=1):
            try:
                recorded = self.group.store.check([ERROR_KEY.format(rank=rank)])
                note = self.group.store.get(ERROR_KEY.format(rank=rank)).decode() if recorded else None
            except Exception:
                note = None
            if note or not proc.is_alive():
                why.append(f"rank {rank} (pid {proc.pid}) " + (f"failed: {note}" if note else
                                                               f"exited with code {proc.exitcode}"))
        return RankFailed("tensor parallel: " + ("; ".join(why) or f"a collective failed: {cause}"))

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Every rank allocates ``num_blocks`` blocks of its own KV heads."""
        self._send(("allocate", num_blocks, max_model_len))
        self.runner.allocate_kv_cache(num_blocks, max_model_len)

    def kv_cache_bytes(self, max_num_batched_tokens: int, utilization: float, block_bytes: int, block_size: int,
                       max_model_len: int) -> int:
        """CUDA: the KV pool each rank can hold after profiling its own memory (the smallest of them)."""
        self._send(("profile", max_num_batched_tokens, utilization, block_bytes, block_size, max_model_len))
        plan = plan_kv_cache(self.runner.profile_memory(max_num_batched_tokens), utilization, block_bytes,
                             block_size, max_model_len)
        try:
            return self.group.min_over_ranks(plan.kv_cache_bytes)
        except RuntimeError as e:
            raise self.failure(e) from e

    def run(self, batch: SchedulerOutput, sample_rows: list[int]) -> StepOutput:
        return self.run_with_prompt_logprobs(batch, sample_rows, [])

    def run_with_prompt_logprobs(self, batch: SchedulerOutput, sample_rows: list[int],
                                 spans: list[PromptSpan]) -> StepOutput:
        try:
            return self.runner.run_with_prompt_logprobs(batch, sample_rows, spans)
        except RankFailed:
            raise
        except RuntimeError as e:  # a collective whose peer went away
            if any(not p.is_alive() for p in self.workers) or "Connection closed" in str(e):
                raise self.failure(e) from e
            raise

    def close(self) -> None:
        """Stop the workers (asked first, then terminated); idempotent."""
        asked = False
        if self.group is not None and all(p.is_alive() for p in self.workers):
            try:
                self.group.broadcast_object(("stop",))
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
