"""Serving one model on several processes: tensor parallelism over torch.distributed process
groups (gloo on CPUs, NCCL on GPUs), with one scheduler on rank 0 whose step inputs every rank
receives (vLLM's multiprocessing executor has the same shape).

- :mod:`.group`: the ranks' process groups and the collectives the model and the executor use.
- :mod:`.executor`: :class:`~.executor.ParallelRunner`, the engine's step runner on rank 0, which
  starts the other ranks as worker processes and drives them.
- :mod:`.worker`: a worker rank's loop.

The model side (which slice of each weight a rank keeps, and where the all-reduces go) is
:mod:`slipstream.server.models.tensor_parallel`.
"""
