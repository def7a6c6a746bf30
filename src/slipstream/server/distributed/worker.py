"""A worker rank: a process started by rank 0's :class:`~.executor.ParallelRunner` that loads
its slice of the model (its pipeline stage's layers, its tensor rank's share of each) and then
does what rank 0 broadcasts, step after step, until told to stop or rank 0 goes away.

Commands (tuples, pickled over the control group):
``("profile", max_num_batched_tokens, utilization, block_size, max_model_len)`` (CUDA: profile
this rank's memory; every rank then takes the fewest KV blocks any rank can hold),
``("allocate", num_blocks, max_model_len)``, ``("step", host_step, logits_rows)``, ``("ping",)``
(rank 0 is idle and checks that every rank answers) and ``("stop",)``.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ..engine.config import DTYPES, EngineConfig
from ..engine.memory import plan_kv_cache
from ..engine.model_runner import ModelRunner
from ..models.loader import LoadedModel, ModelLoadError, load_model
from .group import ParallelGroups
from .pipeline import run_stage

log = logging.getLogger("slipstream.engine")

ERROR_KEY = "error/{rank}"  # in the group's store: why a rank failed, for rank 0's message


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join its groups: the engine's settings, its global rank, where rank
    0's store listens, the device and dtype (``"cpu"``, ``"cuda:N"``; ``"float32"``, …), its
    torch thread count (the cores are shared between the ranks of one machine) and the pid of the
    process that started it (the worker exits when that process is gone)."""

    config: EngineConfig
    rank: int
    host: str
    port: int
    device: str
    dtype: str
    num_threads: int
    parent_pid: int


def join(config: EngineConfig, rank: int, host: str, port: int, device: torch.device, dtype: torch.dtype,
         check_ranks=None) -> tuple[ParallelGroups, LoadedModel, ModelRunner]:
    """Join the groups as ``rank`` and load this rank's slice: what rank 0 and every worker do first."""
    groups = ParallelGroups(rank, config.tensor_parallel_size, config.pipeline_parallel_size, host, port, device,
                            check_ranks=check_ranks)
    loaded = load_model(config.model, device, dtype, config.quantization, tensor_parallel=groups.tensor,
                        pipeline_stage=(groups.stage, groups.pipeline_size))
    runner = ModelRunner(loaded.model, config.block_size, device, dtype, max_num_seqs=config.max_num_seqs,
                         graphs=False)
    return groups, loaded, runner


def block_bytes(runner: ModelRunner, block_size: int) -> int:
    """Bytes of one KV block on this rank: its own layers and KV heads."""
    return block_size * runner.model.cfg.kv_bytes_per_token(torch.finfo(runner.dtype).bits // 8)


def exit_with_parent(parent_pid: int, rank: int, interval: float = 0.5) -> None:
    """Exit this process (code 1) as soon as ``parent_pid`` is no longer its parent: a rank 0 (or
    node process) that was killed, even while this rank still waits for the rendezvous or loads
    its slice, leaves no orphan behind. Runs on a daemon thread."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    log.error("rank %d: the process that started it (pid %d) is gone; exiting", rank, parent_pid)
    os._exit(1)


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing ``spawn``). Exits 1 after recording why
    in the group's store when loading or a step fails; exits 0 on ``("stop",)``; exits 1 when
    the process that started it is gone. Ignores SIGINT: a Ctrl-C in a terminal reaches the
    whole process group, and rank 0 drains its requests and then stops the workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("SLIPSTREAM_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=exit_with_parent, args=(spec.parent_pid, spec.rank), daemon=True,
                     name="parent-watch").start()
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = None
    try:
        groups, _, runner = join(spec.config, spec.rank, spec.host, spec.port, device, DTYPES[spec.dtype])
        serve(groups, runner)
    except Exception as e:
        try:
            if groups is not None:
                groups.store.set(ERROR_KEY.format(rank=spec.rank), f"{type(e).__name__}: {e}")
        except Exception:  # rank 0 (the store's host) is gone: nobody to tell
            pass
        if isinstance(e, ModelLoadError):  # rank 0 meets the same error and says it
            log.error("rank %d: %s", spec.rank, e)
        else:
            traceback.print_exc()
        sys.exit(1)


def serve(groups: ParallelGroups, runner: ModelRunner) -> None:
    """Run rank 0's commands until ``("stop",)``."""
    while True:
        command = groups.broadcast_object()
        kind = command[0]
        if kind == "step":
            if groups.pipeline_size > 1:
                run_stage(groups, runner, command[1], command[2])
            else:
                runner.replay(command[1], command[2])
        elif kind == "allocate":
            runner.allocate_kv_cache(command[1], command[2])
        elif kind == "profile":
            tokens, utilization, block_size, max_model_len = command[1:]
            own = block_bytes(runner, block_size)
            plan = plan_kv_cache(runner.profile_memory(tokens), utilization, own, block_size, max_model_len)
            groups.min_over_ranks(plan.kv_cache_bytes // own)
        elif kind == "ping":  # rank 0, idle, checking that every rank still answers
            pass
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
