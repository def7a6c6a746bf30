"""The process groups of a tensor-parallel set of ranks and the collectives over them.

Groups are built from a ``TCPStore`` directly (no ``init_process_group``): a process may hold
several engines (tests, benchmarks) and each engine's group is its own object, torn down with it.
Two groups per set: ``control`` (gloo, on the CPU) carries the pickled step inputs rank 0 sends
every step; ``device`` (gloo on CPU, NCCL on CUDA) carries the model's activations.
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


class TensorParallelGroup:
    """Rank ``rank`` of ``size`` ranks that split every layer between them.

    Args:
        rank, size: this process's rank and the number of ranks (``0 ≤ rank < size``).
        host, port: the ``TCPStore`` rank 0 listens on; the others connect to it.
        device: where activations live: ``cpu`` (gloo) or ``cuda:N`` (NCCL).
        timeout: how long a collective, or the store's rendezvous, may wait.
        check_ranks: rank 0, while it waits for the others to join: called every 0.1 s, raises
            when a rank can no longer come (its process exited), so a failed start never hangs.

    Raises:
        RuntimeError, DistStoreError: the rendezvous failed (a rank did not come, the port is taken).
    """

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout: datetime.timedelta = TIMEOUT, check_ranks: Callable[[], None] | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in 0..{size - 1}")
        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout, wait_for_workers=False)
        if rank:
            self.store.set(f"joined/{rank}", "1")
        else:
            self._wait_for_ranks(timeout, check_ranks)
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, size, timeout)
        if self.device.type == "cuda":
            self.activations = dist.ProcessGroupNCCL(dist.PrefixStore("device", self.store), rank, size)
        else:
            self.activations = dist.ProcessGroupGloo(dist.PrefixStore("device", self.store), rank, size, timeout)

    def _wait_for_ranks(self, timeout: datetime.timedelta, check_ranks: Callable[[], None] | None) -> None:
        keys = [f"joined/{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.store.check(keys):
            if check_ranks is not None:
                check_ranks()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel: not every rank joined within {timeout}")
            time.sleep(0.1)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self.activations.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each), concatenated along the last dim in rank order:
        ``[..., n]`` → ``[..., size × n]``."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.activations.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=-1)

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
