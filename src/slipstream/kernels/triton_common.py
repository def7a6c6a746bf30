"""What the Triton attention kernels share: the online-softmax inner loop and launch checks.

The inner loop is FlashAttention's (Dao et al., NeurIPS '22, §3.1; FlashAttention-2, Dao 2023,
§3.1): keys are visited tile by tile, keeping a running row maximum ``m``, a running sum of
exponentials ``l`` and an unnormalized output ``acc``, all in fp32, so the score matrix never
leaves registers. Keys are gathered through the request's block table as in PagedAttention
(Kwon et al., SOSP '23, §4.1): context token ``j`` sits in block ``table[j // block_size]`` at
offset ``j % block_size``. Two options shape the scores: a sliding window (Longformer, Beltagy et
al. 2020, §3.1; Mistral 7B, Jiang et al. 2023, §2) hides keys at or before ``q_pos - window``, and
attention logit soft-capping (Gemma 2, Gemma Team 2024, §2) maps each scaled score ``s`` to
``softcap * tanh(s / softcap)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _interpreted() -> bool:
    # Triton 3.9 reads TRITON_INTERPRET when a kernel is decorated, its own library's (triton.language,
    # on first import) included: both must have been defined under the interpreter.
    return bool(triton.knobs.runtime.interpret) and not isinstance(tl.standard.cdiv, triton.runtime.JITFunction)


# Whether this module's kernels run in Triton's interpreter (on CPU tensors) rather than compiled.
INTERPRETED = _interpreted()

# A finite floor for the running maximum: a row that sees no key in a tile keeps alpha = 1, not NaN.
NEG_BIG = -1.0e30
LOG2E = 1.4426950408889634
# The window of a full-attention call: larger than any context, small enough that q_pos - it fits int32.
NO_WINDOW = 1 << 30


def score_args(scale: float, window: int | None, softcap: float | None) -> tuple[float, int, float]:
    """``(qk_scale, window, cap)`` for :func:`attend_key_range`: with a soft-cap the dot product is
    scaled to ``s / softcap`` and the tanh multiplied by ``softcap * log2(e)``, else by
    ``scale * log2(e)`` at once; no window becomes ``NO_WINDOW``.

    Raises:
        ValueError: ``window`` below 1 or ``softcap`` not positive.
    """
    from .reference import check_options

    check_options(window, softcap)
    if softcap is None:
        return scale * LOG2E, window or NO_WINDOW, 0.0
    return scale / softcap, window or NO_WINDOW, softcap * LOG2E


def check_runnable(tensor: torch.Tensor) -> None:
    """Raise if the Triton kernels cannot run on ``tensor``'s device in this process.

    Raises:
        RuntimeError: CPU tensors while Triton's interpreter is off, or was off when Triton or
            these kernels were first imported.
    """
    # The flag is read again at launch (lazy imports inside Triton check it), so it must still be set.
    if tensor.is_cuda or (INTERPRETED and triton.knobs.runtime.interpret):
        return
    raise RuntimeError(
        f"the Triton attention kernels got {tensor.device.type} tensors, but they run on CPU only in "
        "Triton's interpreter: set TRITON_INTERPRET=1 in the environment before the process first "
        "imports triton, and keep it set (Triton reads it when it defines kernels and again at "
        "launch), or set SLIPSTREAM_ATTENTION=torch (or auto) to use the torch reference on CPU")


def compute_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast K/V/Q to fp32 before the dot products.

    fp32 inputs are fp32 anyway. bf16 is upcast only in the interpreter, which does not do bf16
    arithmetic (it stores bf16 as uint16; triton-lang/triton#11584); on a GPU bf16 and fp16 feed
    the tensor cores directly and only the accumulators are fp32.
    """
    return dtype == torch.float32 or (INTERPRETED and dtype == torch.bfloat16)


def check_inputs(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Validate what the kernels assume about layouts and dtypes.

    Raises:
        ValueError: mismatched dtypes, shapes or strides, or a non-unit stride on ``head_dim``.
    """
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"query and KV cache dtypes must match, got query {query.dtype}, "
                         f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"attention supports float16, bfloat16 and float32, got {query.dtype}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share shape and strides, got {tuple(k_cache.shape)} "
                         f"{k_cache.stride()} and {tuple(v_cache.shape)} {v_cache.stride()}")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous (stride 1) dimension of query and caches")


@triton.jit
def _tanh(x):
    # tl has no tanh; exp2 of -2|x| keeps it finite for large |x| (2.885... = 2 * log2(e)).
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def attend_key_range(acc, m_i, l_i, q, q_pos, key_start, key_end,
                     k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
                     stride_cb, stride_cs, stride_ch, qk_scale, window, cap,
                     BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                     SOFTCAP: tl.constexpr, COMPUTE_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold keys ``[key_start, key_end)`` into the running softmax state of rows ``q``.

    ``q`` is ``[rows, HEAD_DIM_PAD]``; row ``r`` sees key ``j`` iff
    ``q_pos[r] - window < j <= q_pos[r]`` (causal, sliding window). ``qk_scale``, ``window`` and
    ``cap`` come from :func:`score_args`: the scores end up in log2 units, so exponentials are
    ``exp2``; ``SOFTCAP`` applies ``cap * tanh``. An empty range leaves the state as it is.
    Returns the updated ``(acc [rows, HEAD_DIM_PAD], m_i [rows], l_i [rows])``, fp32.
    """
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    for tile_start in range(key_start, key_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)
        k_ok = k_pos < key_end
        # Per-token block lookup: a tile may span several (or part of one) cache blocks.
        block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        rows = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        offsets = rows[:, None] + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0)
        if COMPUTE_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = _tanh(s) * cap
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i
