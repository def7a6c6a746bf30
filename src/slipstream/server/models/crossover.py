"""Where a CPU linear layer changes method, measured on this machine at start-up and cached.

Two row counts decide how a CPU linear runs:

- ``small_batch_rows`` (:data:`.layers.SMALL_BATCH_ROWS`): fp32 weights, up to this many rows run as
  ``W @ x.T`` (:func:`.layers.small_batch_linear`); MKL's ``x @ W.T`` re-streams the weight per row
  or two at small M, and wins again from some batch size on.
- ``kernel_max_rows`` (:data:`.quant.KERNEL_MAX_ROWS`): GGML blocks, up to this many rows go
  through the block kernel (every weight dequantized once per eight rows); more rows dequantize
  the weight once into fp32 for the dense GEMM.

Both depend on the machine (cores, vector width, caches) and the thread count; the defaults were
measured on one 2-core VM. :func:`calibrate` times both methods on the served model's own
weights at growing row counts, over every layer of its largest projection in turn (so the
weights stream from memory as in a forward pass, not from a warm cache), and stops at the first
row count where the other method wins or after :data:`BUDGET_S` seconds (then the crossing
lies beyond the rows measured, and the default stands if it is larger). It keeps the result under
``$SLIPSTREAM_CACHE_DIR/crossovers``, keyed by the CPU, torch, the thread count and the weight's
shape and type, so later starts only read it. ``SLIPSTREAM_CALIBRATE=0`` keeps the defaults
(the test suite does, so that which method runs does not depend on the machine).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..weights import disk_cache
from . import layers as shared_layers, quant

log = logging.getLogger("slipstream.loader")

SMALL_BATCH_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16)
KERNEL_CANDIDATES = (4, 8, 16, 32, 64, 128, 256)
REPEATS = 2  # timed passes per method and row count, after one warm-up pass
BUDGET_S = 0.6  # seconds of measuring per crossover at most


@dataclass(frozen=True)
class Crossovers:
    """Row counts (see the module docstring); 0 means the other method from one row on."""
    small_batch_rows: int = 4
    kernel_max_rows: int = 16


def crossover(rows: Sequence[int], timings: Iterable[tuple[float, float]], prior: int = 0) -> int:
    """The largest of ``rows`` (ascending) up to which the direct method is no slower than the
    dense one: ``timings`` gives (direct, dense) seconds per row count and is read only up to
    the first where dense wins (so a generator measures no further); 0 if dense wins from the
    first, the last candidate if it never does. Timings that end early (a time budget) leave the
    crossing unknown beyond the last row count measured: then ``prior`` if it is larger."""
    best, measured = 0, 0
    for r, (direct, dense) in zip(rows, timings):
        measured += 1
        if dense < direct:
            return best
        best = r
    return best if measured == len(rows) else max(best, prior)


def apply(c: Crossovers) -> None:
    """Make the model code use ``c`` (process-wide: one machine, one thread count)."""
    shared_layers.SMALL_BATCH_ROWS = c.small_batch_rows
    quant.KERNEL_MAX_ROWS = c.kernel_max_rows


def calibrate(model: nn.Module, threads: int) -> Crossovers:
    """The crossovers for ``model``'s largest fp32 and quantized linear layers on this CPU at
    ``threads`` torch threads: from the cache, else measured and cached. Defaults for a kind of
    layer the model lacks, and for all with ``SLIPSTREAM_CALIBRATE=0``. Never raises for a
    cache it cannot write (it warns)."""
    if os.environ.get("SLIPSTREAM_CALIBRATE", "1") == "0":
        return Crossovers()
    dense = _projections(model, shared_layers.Linear)
    blocks = _projections(model, quant.QuantLinear)
    key = _key(threads, dense[:1], blocks[:1])
    path = disk_cache.cache_dir() / "crossovers" / f"{key}.json"
    try:
        return Crossovers(**json.loads(path.read_text()))
    except FileNotFoundError:
        pass
    except (ValueError, TypeError) as e:  # a damaged file is measured again, never fatal
        log.warning("crossover cache %s unreadable (%s); measuring again", path, e)
    t0 = time.perf_counter()
    defaults = Crossovers()
    found = Crossovers(
        small_batch_rows=measure_small_batch(dense) if dense else defaults.small_batch_rows,
        kernel_max_rows=measure_kernel(blocks) if blocks else defaults.kernel_max_rows)
    log.info("CPU linear crossovers at %d thread(s): W @ x.T up to %d rows, quantized kernel up to %d rows "
             "(measured in %.2f s, cached in %s)", threads, found.small_batch_rows, found.kernel_max_rows,
             time.perf_counter() - t0, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        disk_cache.write_atomic(path, json.dumps(asdict(found)))
    except OSError as e:
        log.warning("cannot cache the crossovers in %s: %s", path, e)
    return found


def measure_small_batch(layers: Sequence[nn.Linear], candidates: Sequence[int] = SMALL_BATCH_CANDIDATES) -> int:
    """:func:`crossover` of ``W @ x.T`` against ``F.linear`` over ``layers``' fp32 weights
    (one shape)."""
    weights = [layer.weight.detach() for layer in layers]
    return crossover(candidates, _timings(
        candidates, weights[0].shape[1],
        lambda x: [shared_layers.small_batch_linear(x, w) for w in weights],
        lambda x: [F.linear(x, w) for w in weights]), prior=Crossovers().small_batch_rows)


def measure_kernel(layers: Sequence["quant.QuantLinear"], candidates: Sequence[int] = KERNEL_CANDIDATES) -> int:
    """:func:`crossover` of the block kernel against dequantize-then-GEMM over ``layers``'
    blocks (one shape and type)."""
    from slipstream.kernels import ggml_cpu

    qtype, k = layers[0].qtype, layers[0].in_features
    blocks = [layer.blocks for layer in layers]
    return crossover(candidates, _timings(
        candidates, k,
        lambda x: [ggml_cpu.matmul(x, b, qtype, k) for b in blocks],
        lambda x: [F.linear(x, ggml_cpu.dequantize(b, qtype, k)) for b in blocks]), prior=Crossovers().kernel_max_rows)


def _timings(candidates: Sequence[int], k: int, direct: Callable, dense: Callable,
             budget_s: float = BUDGET_S) -> Iterator[tuple[float, float]]:
    """(direct, dense) best-of-:data:`REPEATS` seconds per row count, measured only as they are
    read and none once ``budget_s`` seconds have gone; the two methods alternate so that a burst
    of other load hits both alike."""
    gen = torch.Generator().manual_seed(0)
    deadline = time.perf_counter() + budget_s
    for rows in candidates:
        if time.perf_counter() > deadline:
            return
        x = torch.randn(rows, k, generator=gen)
        best = [float("inf"), float("inf")]
        with torch.inference_mode():
            for _ in range(REPEATS + 1):  # the first pass warms up
                for i, fn in enumerate((direct, dense)):
                    t0 = time.perf_counter()
                    fn(x)
                    best[i] = min(best[i], time.perf_counter() - t0)
        yield best[0], best[1]


def _projections(model: nn.Module, kind: type) -> list[nn.Module]:
    """The ``kind`` layers of the largest shape (and type), e.g. every decoder layer's fused MLP
    projection: what dominates a forward pass (the LM head runs once per step and is left out)."""
    layers = [m for name, m in model.named_modules() if type(m) is kind and "lm_head" not in name]
    if not layers:
        return []
    shape = max((m.out_features, m.in_features, getattr(m, "qtype", "")) for m in layers)
    return [m for m in layers if (m.out_features, m.in_features, getattr(m, "qtype", "")) == shape]


def _key(threads: int, dense: Sequence[nn.Module], blocks: Sequence[nn.Module]) -> str:
    from slipstream.kernels import cpu_native

    shapes = [[list(m.weight.shape) for m in dense], [[m.out_features, m.in_features, m.qtype] for m in blocks]]
    lib = cpu_native.library()  # its name holds the path (ISA) and the hash of its sources
    text = json.dumps([cpu_native.cpu_flags(), torch.__version__, threads, shapes,
                       os.path.basename(lib.path) if lib is not None else None])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
