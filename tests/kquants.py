"""A test-only encoder of fp32 weights into llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), which
the gguf package can read but not write. Any bytes in the layout are a valid file; the scales
are chosen plainly (per-sub-block min and max, then 6-bit or int8 scales of those), not with
llama.cpp's search, so the weights are close to the input but not what llama-quantize writes.
The oracle never depends on that: it runs on the gguf package's dequantization of these bytes.
"""
from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    """``[n]`` fp32 → ``[n, 2]`` uint8 (fp16 bytes)."""
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _scale_min_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``[n, 8]`` 6-bit scales and mins → ``[n, 12]`` packed as ggml's get_scale_min_k4 reads them."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _affine(x: np.ndarray, levels: int):
    """Super-blocks ``[n, 8, 32]`` → fp16 d, dmin ``[n]``, 6-bit sc, m ``[n, 8]`` and q ``[n, 8, 32]``
    with ``w ≈ (d * sc) * q - dmin * m``, q in ``[0, levels)``."""
    lo = np.minimum(x.min(axis=-1), 0)
    span = x.max(axis=-1) - lo
    d = (span.max(axis=-1) / (levels - 1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(span / (levels - 1) / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.round((x + (dmin[:, None] * m)[..., None]) / np.where(step == 0, 1, step))
    return d, dmin, sc, m, np.clip(q, 0, levels - 1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``[n, 8, 32]`` values < 16 → ``[n, 128]``: sub-block 2i in byte 32i+l's low half, 2i+1 in its high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """``[rows, cols]`` fp32, ``cols`` a multiple of 256 → ``[rows, cols / 256 * block bytes]`` uint8."""
    rows, cols = w.shape
    assert cols % QK_K == 0, cols
    x = w.astype(np.float32).reshape(-1, 8, 32)
    n = x.shape[0]
    if qtype in ("Q4_K", "Q5_K"):
        levels = 16 if qtype == "Q4_K" else 32
        d, dmin, sc, m, q = _affine(x, levels)
        parts = [_f16(d), _f16(dmin), _scale_min_bytes(sc, m)]
        if qtype == "Q5_K":  # bit c of byte l: sub-block c's weight l, fifth bit
            parts.append(((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
        parts.append(_nibbles(q & 15))
    elif qtype == "Q6_K":
        s = x.reshape(n, 16, 16)
        sub = np.abs(s).max(axis=-1) / 31
        d = (sub.max(axis=-1) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(sub / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
        step = (d[:, None] * sc)[..., None]
        q = (np.clip(np.round(s / np.where(step == 0, 1, step)), -32, 31) + 32).astype(np.uint8).reshape(n, 8, 32)
        # chunk k of 32: low nibbles in ql[64(k/4) + 32(k%2) + l] (shifted 4 for k/2 odd), high pairs
        # in qh[32(k/4) + l] at bit 2(k%4)
        ql = np.zeros((n, 128), np.uint8)
        qh = np.zeros((n, 64), np.uint8)
        for k in range(8):
            lo = 64 * (k // 4) + 32 * (k % 2)
            ql[:, lo:lo + 32] |= (q[:, k] & 15) << (4 * ((k // 2) % 2))
            qh[:, 32 * (k // 4):32 * (k // 4) + 32] |= (q[:, k] >> 4) << (2 * (k % 4))
        parts = [ql, qh, sc.view(np.uint8), _f16(d)]
    else:
        raise ValueError(qtype)
    return np.concatenate(parts, axis=1).reshape(rows, -1)
