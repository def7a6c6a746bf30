"""Attention over the paged KV cache: Triton kernels on CUDA, the torch reference elsewhere.

The engine resolves an :class:`AttentionBackend` once per model runner (:func:`resolve_backend`)
and its layers call the backend's ``write_kv`` and ``paged_attention``. The module-level
:func:`write_kv` and :func:`paged_attention` choose per call instead (tests, one-off use). Either
way the choice comes from the device and ``SLIPSTREAM_ATTENTION``:

- ``auto`` (default): Triton on CUDA tensors; on CPU tensors :mod:`.cpu_attention` (decode rows
  in the compiled C kernel, the rest in the reference) where the CPU kernels build, else the
  torch reference;
- ``torch``: always the reference;
- ``triton``: always Triton. On CPU tensors that needs Triton's interpreter, i.e.
  ``TRITON_INTERPRET=1`` set before the Triton kernels are first imported.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from . import reference
from .metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "write_kv", "paged_attention", "resolve_backend",
           "select_backend"]

ENV_VAR = "SLIPSTREAM_ATTENTION"
MODES = ("auto", "torch", "triton")


def _triton_backend(forced: bool) -> ModuleType | None:
    # Imported on first use: triton is optional (the `gpu` extra) and slow to import.
    try:
        from . import triton_attention
    except ImportError as exc:
        if forced:
            raise RuntimeError(f"{ENV_VAR}=triton but Triton cannot be imported ({exc}); "
                               "install it with `pip install 'slipstream[gpu]'`") from exc
        warnings.warn(f"CUDA tensors but Triton cannot be imported ({exc}); using the slower torch "
                      "reference attention. Install `slipstream[gpu]` to use the Triton kernels.",
                      RuntimeWarning, stacklevel=3)
        return None
    return triton_attention


def select_backend(tensor: torch.Tensor) -> ModuleType:
    """The module (``reference`` or ``triton_attention``) that attends over ``tensor``'s device.

    Raises:
        ValueError: ``SLIPSTREAM_ATTENTION`` is not one of ``auto``, ``torch``, ``triton``.
        RuntimeError: ``triton`` forced but Triton is missing, or CPU tensors without the
            interpreter.
    """
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "torch":
        return reference
    if mode == "auto" and not tensor.is_cuda:
        from . import cpu_attention, cpu_native
        return cpu_attention if tensor.device.type == "cpu" and cpu_native.available() else reference
    backend = _triton_backend(forced=mode == "triton")
    if backend is None:
        return reference
    from .triton_common import check_runnable
    check_runnable(tensor)
    return backend


@dataclass(frozen=True)
class AttentionBackend:
    """The attention implementation one model runner uses, resolved once.

    Attributes:
        name: ``"torch"`` (the reference), ``"cpu"`` (:mod:`.cpu_attention`) or ``"triton"``.
        write_kv: as :func:`write_kv`.
        paged_attention: as :func:`paged_attention` (``window`` and ``softcap`` included).
        graph_safe: whether a decode step through it can be captured in a CUDA graph: no host
            sync, launch shapes from host-side metadata only (the Triton kernels; the reference
            reads lengths back with ``tolist``).
    """

    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    graph_safe: bool


def resolve_backend(device: torch.device | str) -> AttentionBackend:
    """The backend for tensors on ``device``, chosen as :func:`select_backend` would.

    Raises:
        ValueError, RuntimeError: as :func:`select_backend`.
    """
    module = select_backend(torch.empty(0, device=device))
    if module is reference:
        return AttentionBackend("torch", reference.write_kv, reference.paged_attention, graph_safe=False)
    if module.__name__.endswith(".cpu_attention"):
        return AttentionBackend("cpu", module.write_kv, module.paged_attention, graph_safe=False)
    return AttentionBackend("triton", module.write_kv, module.paged_attention, graph_safe=True)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V through the slot mapping, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, ``block * block_size + offset``; ``-1`` skipped.
    """
    select_backend(key).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the batch's new tokens over their paged context.

    Decode rows, prefill chunks and prefix-cache hits may be mixed in one batch; see
    :func:`reference.paged_attention` for the contract.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding
            the new tokens' K/V.
        meta: the batch layout.
        scale: softmax scale.
        window: sliding window in tokens (a query at position ``p`` sees keys ``p - window < j <= p``);
            None: the whole context. Per call, so interleaved local/global layers pass their own.
        softcap: attention logit soft-cap, ``softcap * tanh(scores / softcap)``; None: none.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.

    Raises:
        ValueError: ``window`` below 1 or ``softcap`` not positive.
    """
    return select_backend(query).paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
