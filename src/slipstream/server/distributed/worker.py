"""A tensor-parallel worker rank: a process started by rank 0's
:class:`~.executor.ParallelRunner` that loads its slice of the model and then does what rank 0
broadcasts, step after step, until told to stop or rank 0 goes away.

Commands (tuples, pickled over the control group):
``("profile", max_num_batched_tokens, utilization, block_bytes, block_size, max_model_len)``
(CUDA: profile this rank's memory; every rank then takes the smallest KV pool),
``("allocate", num_blocks, max_model_len)``, ``("step", host_step, logits_rows)`` and ``("stop",)``.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass

import torch

from ..engine.config import DTYPES, EngineConfig
from ..engine.memory import plan_kv_cache
from ..engine.model_runner import ModelRunner
from ..models.loader import load_model
from .group import TensorParallelGroup

log = logging.getLogger("slipstream.engine")

ERROR_KEY = "error/{rank}"  # in the group's store: why a rank failed, for rank 0's message


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join its group: the engine's settings, its rank, where rank 0's
    store listens, the device and dtype (``"cpu"``, ``"cuda:N"``; ``"float32"``, …) and its
    torch thread count (the cores are shared between the ranks of one machine)."""

    config: EngineConfig
    rank: int
    size: int
    host: str
    port: int
    device: str
    dtype: str
    num_threads: int


def run_worker(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing ``spawn``). Exits 1 after recording why
    in the group's store when loading or a step fails; exits 0 on ``("stop",)``."""
    logging.basicConfig(level=os.environ.get("SLIPSTREAM_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank {spec.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = TensorParallelGroup(spec.rank, spec.size, spec.host, spec.port, device)
    try:
        serve(group, spec)
    except Exception as e:
        try:
            group.store.set(ERROR_KEY.format(rank=spec.rank), f"{type(e).__name__}: {e}")
        except Exception:  # rank 0 (the store's host) is gone: nobody to tell
            pass
        traceback.print_exc()
        sys.exit(1)


def serve(group: TensorParallelGroup, spec: WorkerSpec) -> None:
    """Load this rank's slice and run rank 0's commands until ``("stop",)``."""
    config = spec.config
    device = torch.device(spec.device)
    loaded = load_model(config.model, device, DTYPES[spec.dtype], config.quantization, tensor_parallel=group)
    runner = ModelRunner(loaded.model, config.block_size, device, DTYPES[spec.dtype],
                         max_num_seqs=config.max_num_seqs, graphs=False)
    while True:
        command = group.broadcast_object()
        kind = command[0]
        if kind == "step":
            runner.replay(command[1], command[2])
        elif kind == "allocate":
            runner.allocate_kv_cache(command[1], command[2])
        elif kind == "profile":
            tokens, utilization, block_bytes, block_size, max_model_len = command[1:]
            plan = plan_kv_cache(runner.profile_memory(tokens), utilization, block_bytes, block_size, max_model_len)
            group.min_over_ranks(plan.kv_cache_bytes)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {kind!r} from rank 0")
