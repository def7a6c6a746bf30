"""The process groups of a parallel engine and the collectives over them.

``tensor × pipeline`` ranks; global rank ``r`` is tensor rank ``r % tensor`` of pipeline stage
``r // tensor`` (rank 0: stage 0's first tensor rank, the scheduler). Groups are built from one
``TCPStore`` directly (no ``init_process_group``): a process may hold several engines (tests,
benchmarks) and each engine's groups are its own objects, torn down with it.

- ``control`` (gloo, CPU, every rank): the pickled step inputs rank 0 sends every step.
- ``tensor`` (gloo on CPU, NCCL on CUDA; one per stage): the all-reduces and all-gathers of the
  rank's slice of each layer.
- ``pipeline`` (same backends, every rank): hidden states from a stage to the next, and the last
  stage's logits back to rank 0, point to point.
"""
from __future__ import annotations

import datetime
import pickle
import socket
import time
from typing import Any, Callable

import torch
from torch import distributed as dist

# A collective that waits longer than this fails (a rank that hangs without dying); a rank that
# dies fails its peers' collectives at once ("Connection closed by peer").
TIMEOUT = datetime.timedelta(minutes=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the store's; a race with other binders is possible, and
    the store then fails to start with a clear error)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _device_group(store: dist.Store, prefix: str, rank: int, size: int, device: torch.device,
                  timeout: datetime.timedelta) -> dist.ProcessGroup:
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


class TensorParallelGroup:
    """The ``size`` ranks of one pipeline stage that split each of its layers; this process is
    ``rank`` among them. What :func:`~slipstream.server.models.tensor_parallel.shard_model` needs."""

    def __init__(self, pg: dist.ProcessGroup | None, rank: int, size: int):
        self.pg, self.rank, self.size = pg, rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.size > 1:
            self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each), concatenated along the last dim in rank order:
        ``[..., n]`` → ``[..., size × n]``."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)


class ParallelGroups:
    """This process's place among ``tensor × pipeline`` ranks, and its groups (module docstring).

    Args:
        rank: the global rank (``0 ≤ rank < tensor × pipeline``).
        tensor, pipeline: the ranks per stage and the number of stages.
        host, port: the ``TCPStore`` rank 0 listens on; the others connect to it.
        device: where activations live: ``cpu`` (gloo) or ``cuda:N`` (NCCL).
        timeout: how long a collective, or the store's rendezvous, may wait.
        check_ranks: rank 0, while it waits for the others to join: called every 0.1 s, raises
            when a rank can no longer come (its process exited), so a failed start never hangs.

    Raises:
        RuntimeError, DistStoreError: the rendezvous failed (a rank did not come, the port is taken).
    """

    def __init__(self, rank: int, tensor: int, pipeline: int, host: str, port: int, device: torch.device,
                 timeout: datetime.timedelta = TIMEOUT, check_ranks: Callable[[], None] | None = None):
        self.world_size = tensor * pipeline
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        self.rank, self.tensor_size, self.pipeline_size = rank, tensor, pipeline
        self.stage, self.tensor_rank = divmod(rank, tensor)
        self.device = torch.device(device)
        self.store = dist.TCPStore(host, port, self.world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        if rank:
            self.store.set(f"joined/{rank}", "1")
        else:
            self._wait_for_ranks(timeout, check_ranks)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, self.world_size, timeout)
        tp_pg = _device_group(self.store, f"tensor/{self.stage}", self.tensor_rank, tensor, self.device,
                              timeout) if tensor > 1 else None
        self.tensor = TensorParallelGroup(tp_pg, self.tensor_rank, tensor)
        self.pipeline = _device_group(self.store, "pipeline", rank, self.world_size, self.device,
                                      timeout) if pipeline > 1 else None

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pipeline_size - 1

    def _wait_for_ranks(self, timeout: datetime.timedelta, check_ranks: Callable[[], None] | None) -> None:
        keys = [f"joined/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.store.check(keys):
            if check_ranks is not None:
                check_ranks()
            if time.monotonic() > deadline:
                raise RuntimeError(f"parallel engine: not every rank joined within {timeout}")
            time.sleep(0.1)

    def send(self, t: torch.Tensor, rank: int) -> None:
        """``t`` to global rank ``rank`` over the pipeline group (which must post the matching :meth:`recv`)."""
        self.pipeline.send([t.contiguous()], rank, 0).wait()

    def recv(self, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Fill ``t`` from global rank ``rank``; returns ``t``."""
        self.pipeline.recv([t], rank, 0).wait()
        return t

    def peer(self, stage: int) -> int:
        """The global rank of this tensor rank at ``stage``."""
        return stage * self.tensor_size + self.tensor_rank

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the control group); others pass nothing."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.control.broadcast([length], opts).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(length), dtype=torch.uint8)
        if len(buf):
            self.control.broadcast([buf], opts).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank's KV pool must fit all ranks)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.control.allreduce([t], opts).wait()
        return int(t)
