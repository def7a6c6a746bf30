/* Matrix products over GGML-quantized weights on the CPU, reading the blocks as stored.
 *
 * Block layouts are llama.cpp's (ggml-common.h). 32 weights per block:
 *   Q4_0: fp16 d, 16 bytes of nibbles        w = d * (q - 8)
 *   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles w = d * q + m
 *   Q8_0: fp16 d, 32 int8                    w = d * q
 * Byte i of the nibbles holds weight i in its low half and weight 16 + i in its high half.
 * K-quants, 256 weights per super-block in 8 sub-blocks of 32 (Q6_K: 16 scales of 16):
 *   Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
 *         w = (d * sc) * q - dmin * m, q in [0, 16)
 *   Q5_K: as Q4_K, then 32 bytes of fifth bits before the nibbles; q in [0, 32)
 *   Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
 *         w = (d * sc) * (q - 32), q in [0, 64)
 * Everything below works on chunks of 32 weights: a block, or a sub-block of a super-block.
 *
 * Built with -ffp-contract=off, so a dequantized weight is computed exactly as the gguf package
 * (and transformers' GGUF loader, the oracle) computes it: one fp32 multiply, then one add. The
 * products then differ from a dense fp32 GEMM on those weights only in summation order.
 * GCC vector extensions keep this portable; -march=native picks the widest registers. */
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGML type ids, as gguf.GGMLQuantizationType */
#define PREFETCH_BLOCKS 16             /* chunks ahead of the one being read: ~320 bytes */
#define MAX_ROWS 8                     /* activation rows per pass over a weight row */

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

/* Bytes per block (K-quants: per super-block of 256 weights); 0 for a type without a kernel. */
int ggml_block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Chunks of 32 weights per block: 8 for the K-quants' super-blocks. */
static inline int chunks_per_block(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 8 : 1; }

/* 16 bytes → 16 floats; GCC scalarizes __builtin_convertvector from bytes, so AVX-512 spells it out. */
static inline f32x16 u8_to_f32(u8x16 q) {
#ifdef __AVX512F__
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q));
#else
    return __builtin_convertvector(q, f32x16);
#endif
}

static inline f32x16 i8_to_f32(i8x16 q) {
#ifdef __AVX512F__
    return (f32x16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q));
#else
    return __builtin_convertvector(q, f32x16);
#endif
}

static inline float fp16(const uint8_t *p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* An fp16 scale in all 16 lanes. On AVX-512 a vector conversion: the scalar vcvtsh2ss merges into
 * its destination, which chains every block's conversion to the previous one. */
static inline f32x16 fp16x16(const uint8_t *p) {
#ifdef __AVX512F__
    uint16_t h;
    memcpy(&h, p, 2);
    return (f32x16)_mm512_cvtph_ps(_mm256_set1_epi16((short)h));
#else
    return (f32x16){0} + fp16(p);
#endif
}

/* Weights 0-15 of the block into *lo, 16-31 into *hi. `type` is a constant at every call site. */
static inline __attribute__((always_inline)) void dequant_block(int type, const uint8_t *b, f32x16 *lo, f32x16 *hi) {
    const f32x16 d = fp16x16(b);
    if (type == Q8_0) {
        i8x16 q0, q1;
        memcpy(&q0, b + 2, 16);
        memcpy(&q1, b + 18, 16);
        *lo = i8_to_f32(q0) * d;
        *hi = i8_to_f32(q1) * d;
        return;
    }
    u8x16 q;
    memcpy(&q, b + (type == Q4_1 ? 4 : 2), 16);
#ifdef __AVX512F__
    /* A 4-bit weight takes one of 16 values: compute those (same multiply and add, so the same
     * roundings) and gather the block's weights from them, fewer operations than per weight. */
    const f32x16 nibbles = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    f32x16 table;
    if (type == Q4_1) { /* d and m side by side: one conversion of both, then each in all lanes */
        uint32_t dm;
        memcpy(&dm, b, 4);
        const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)));
        const f32x16 dv = (f32x16)_mm512_permutexvar_ps(_mm512_setzero_si512(), both);
        const f32x16 mv = (f32x16)_mm512_permutexvar_ps(_mm512_set1_epi32(1), both);
        table = nibbles * dv + mv;
    } else {
        table = (nibbles - 8) * d;
    }
    /* vpermps reads only the low 4 bits of each index: the widened bytes index the low nibbles as
     * they are, and shifted right by 4 the high ones (no masking of the bytes first). */
    const __m512i bytes = _mm512_cvtepu8_epi32((__m128i)q);
    *lo = (f32x16)_mm512_permutexvar_ps(bytes, (__m512)table);
    *hi = (f32x16)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), (__m512)table);
    return;
#endif
    if (type == Q4_1) {
        const f32x16 m = fp16x16(b + 2);
        *lo = u8_to_f32(q & 15) * d + m;
        *hi = u8_to_f32(q >> 4) * d + m;
    } else {
        *lo = i8_to_f32((i8x16)(q & 15) - 8) * d;
        *hi = i8_to_f32((i8x16)(q >> 4) - 8) * d;
    }
}

/* Q4_K/Q5_K: sub-block c's 6-bit scale and min from the 12 packed bytes (ggml's get_scale_min_k4). */
static inline void scale_min_k4(const uint8_t *s, int c, uint8_t *sc, uint8_t *m) {
    if (c < 4) {
        *sc = s[c] & 63;
        *m = s[c + 4] & 63;
    } else {
        *sc = (s[c + 4] & 0xF) | ((s[c - 4] >> 6) << 4);
        *m = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
}

/* Sub-block c (0-7) of a K-quant super-block `b`: weights 32c..32c+15 into *lo, the next 16 into
 * *hi. Scales are multiplied as the gguf package does: d * sc and dmin * m first, each rounded. */
static inline __attribute__((always_inline)) void dequant_k_chunk(int type, const uint8_t *b, int c, f32x16 *lo,
                                                                 f32x16 *hi) {
    if (type == Q6_K) {
        const uint8_t *ql = b + 64 * (c / 4) + 32 * (c % 2), *qh = b + 128 + 32 * (c / 4);
        const int lshift = 4 * ((c / 2) % 2), hshift = 2 * (c % 4);
        const f32x16 d = fp16x16(b + 208);
        u8x16 l0, l1, h0, h1;
        memcpy(&l0, ql, 16);
        memcpy(&l1, ql + 16, 16);
        memcpy(&h0, qh, 16);
        memcpy(&h1, qh + 16, 16);
        const i8x16 q0 = (i8x16)(((l0 >> lshift) & 15) | (((h0 >> hshift) & 3) << 4)) - 32;
        const i8x16 q1 = (i8x16)(((l1 >> lshift) & 15) | (((h1 >> hshift) & 3) << 4)) - 32;
        const f32x16 s0 = d * (float)(int8_t)b[192 + 2 * c], s1 = d * (float)(int8_t)b[192 + 2 * c + 1];
        *lo = i8_to_f32(q0) * s0;
        *hi = i8_to_f32(q1) * s1;
        return;
    }
    uint8_t sc, m;
    scale_min_k4(b + 4, c, &sc, &m);
    const uint8_t *qs = b + (type == Q5_K ? 48 : 16) + 32 * (c / 2);
    const int shift = 4 * (c % 2);
    u8x16 q0, q1;
    memcpy(&q0, qs, 16);
    memcpy(&q1, qs + 16, 16);
#ifdef __AVX512F__
    /* As dequant_block: the 16 (Q4_K) or 32 (Q5_K) values a weight can take, computed with the
     * same multiply and subtract, then gathered by index (vpermps reads 4 index bits, vpermi2ps 5). */
    const f32x16 dsc_v = fp16x16(b) * (float)sc, dm_v = fp16x16(b + 2) * (float)m;
    const f32x16 nibbles = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m512 t0 = (__m512)(nibbles * dsc_v - dm_v);
    __m512i i0 = _mm512_cvtepu8_epi32((__m128i)q0), i1 = _mm512_cvtepu8_epi32((__m128i)q1);
    if (shift) {
        i0 = _mm512_srli_epi32(i0, 4);
        i1 = _mm512_srli_epi32(i1, 4);
    }
    if (type == Q4_K) {
        *lo = (f32x16)_mm512_permutexvar_ps(i0, t0);
        *hi = (f32x16)_mm512_permutexvar_ps(i1, t0);
        return;
    }
    const __m512 t1 = (__m512)((nibbles + 16) * dsc_v - dm_v);
    u8x16 h0, h1;
    memcpy(&h0, b + 16, 16);
    memcpy(&h1, b + 32, 16);
    const __m512i fifteen = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1), cv = _mm512_set1_epi32(c);
    /* index = the nibble | bit c of the weight's high byte as bit 4 */
    const __m512i x0 = _mm512_or_si512(_mm512_and_si512(i0, fifteen), _mm512_slli_epi32(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32((__m128i)h0), cv), one), 4));
    const __m512i x1 = _mm512_or_si512(_mm512_and_si512(i1, fifteen), _mm512_slli_epi32(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32((__m128i)h1), cv), one), 4));
    *lo = (f32x16)_mm512_permutex2var_ps(t0, x0, t1);
    *hi = (f32x16)_mm512_permutex2var_ps(t0, x1, t1);
    return;
#endif
    const float dsc = fp16(b) * (float)sc, dm = fp16(b + 2) * (float)m;
    q0 = (q0 >> shift) & 15;
    q1 = (q1 >> shift) & 15;
    if (type == Q5_K) { /* bit c of byte l is weight l's fifth bit */
        u8x16 h0, h1;
        memcpy(&h0, b + 16, 16);
        memcpy(&h1, b + 32, 16);
        q0 |= ((h0 >> c) & 1) << 4;
        q1 |= ((h1 >> c) & 1) << 4;
    }
    *lo = u8_to_f32(q0) * dsc - dm;
    *hi = u8_to_f32(q1) * dsc - dm;
}

/* Chunk c of block b: the one place that knows both layouts. `type` is a constant at every call. */
static inline __attribute__((always_inline)) void dequant_chunk(int type, const uint8_t *b, int c, f32x16 *lo,
                                                               f32x16 *hi) {
    if (chunks_per_block(type) == 1) dequant_block(type, b, lo, hi);
    else dequant_k_chunk(type, b, c, lo, hi);
}

/* a * b + c, fused where the CPU has it (the dot product's rounding, never a dequantization's). */
static inline f32x16 fma16(f32x16 a, f32x16 b, f32x16 c) {
#ifdef __AVX512F__
    return (f32x16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return a * b + c;
#endif
}

static inline float hsum(f32x16 v) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)v);
#else
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
#endif
}

/* y[r, j] for `nr` weight rows (w, w + row_bytes, ...) against `rows` rows of x, every weight
 * dequantized once for all of them. `type`, `nr` and `rows` are constants at each call, so the
 * accumulators (nr * rows) and x's blocks (2 * rows) stay in registers. */
static inline __attribute__((always_inline)) void dot_tile(int type, int nr, int rows, const uint8_t *w,
                                                           int64_t row_bytes, int64_t nb, int bytes,
                                                           const float *x, int64_t K, float *y, int64_t N) {
    const int cpb = chunks_per_block(type);
    f32x16 acc[4][MAX_ROWS];
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = (f32x16){0};
    for (int64_t bb = 0; bb < nb / cpb; bb++) { /* bb: block; its chunks unrolled so each c is a
                                                  * constant (a K-quant's shifts by c are then
                                                  * immediates, not per-byte variable shifts) */
#pragma GCC unroll 8
        for (int c = 0; c < cpb; c++) {
            const int64_t b = bb * cpb + c; /* chunk of 32 weights */
            f32x16 xl[MAX_ROWS], xh[MAX_ROWS];
            for (int r = 0; r < rows; r++) {
                memcpy(&xl[r], x + r * K + b * 32, 64);
                memcpy(&xh[r], x + r * K + b * 32 + 16, 64);
            }
            for (int j = 0; j < nr; j++) {
                f32x16 lo, hi;
                const uint8_t *block = w + j * row_bytes + bb * bytes;
                __builtin_prefetch(w + j * row_bytes + (b + PREFETCH_BLOCKS) * bytes / cpb);
                dequant_chunk(type, block, c, &lo, &hi);
                for (int r = 0; r < rows; r++) acc[j][r] = fma16(hi, xh[r], fma16(lo, xl[r], acc[j][r]));
            }
        }
    }
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < rows; r++) y[r * N + j] = hsum(acc[j][r]);
}

/* Weight rows per tile for a given number of x rows: as many as the registers hold. */
static inline int tile_rows(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

#define TILE(T, NR, R) dot_tile(T, NR, R, wn, row_bytes, nb, bytes, xm, K, ym, N)
#define TILES(T)                                                                              \
    if (nr == 1) {                                                                            \
        switch (rows) {                                                                       \
        case 1: TILE(T, 1, 1); break; case 2: TILE(T, 1, 2); break;                           \
        case 3: TILE(T, 1, 3); break; case 4: TILE(T, 1, 4); break;                           \
        case 5: TILE(T, 1, 5); break; case 6: TILE(T, 1, 6); break;                           \
        case 7: TILE(T, 1, 7); break; default: TILE(T, 1, 8); break;                          \
        }                                                                                     \
    } else if (nr == 2) {                                                                     \
        switch (rows) { case 3: TILE(T, 2, 3); break; default: TILE(T, 2, 4); break; }        \
    } else {                                                                                  \
        switch (rows) { case 1: TILE(T, 4, 1); break; default: TILE(T, 4, 2); break; }        \
    }

#define ALL_TYPES                                                                             \
    switch (type) {                                                                           \
    case Q4_1: TILES(Q4_1) break; case Q4_0: TILES(Q4_0) break; case Q8_0: TILES(Q8_0) break; \
    case Q4_K: TILES(Q4_K) break; case Q5_K: TILES(Q5_K) break; default: TILES(Q6_K) break;   \
    }

/* y [M, N] = x [M, K] @ W^T, W being N rows of blocks of `type`. x and y fp32, row-major.
 * Returns 0, or -1 for an unknown type or a K that is not a whole number of blocks. */
int ggml_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int threads) {
    const int bytes = ggml_block_bytes(type);
    if (!bytes || K % (32 * chunks_per_block(type))) return -1;
    const int64_t nb = K / 32, row_bytes = nb / chunks_per_block(type) * bytes;
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
        const int rows = M - m0 < MAX_ROWS ? (int)(M - m0) : MAX_ROWS;
        const int step = tile_rows(rows);
        const int64_t tiles = (N + step - 1) / step;
        const float *xm = x + m0 * K;
        #pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n = t * step;
            const uint8_t *wn = w + n * row_bytes;
            float *ym = y + m0 * N + n;
            const int nr = N - n < step ? 1 : step;
            if (nr < step) { /* the last, partial tile: one weight row at a time */
                for (int64_t i = n; i < N; i++, wn += row_bytes, ym++) {
                    const int nr = 1;
                    ALL_TYPES
                }
                continue;
            }
            ALL_TYPES
        }
    }
    return 0;
}

/* out [R, K] fp32 = rows `ids` (or 0..R-1 when ids is NULL) of W dequantized. Same return codes. */
int ggml_dequantize(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t R, float *out, int threads) {
    const int bytes = ggml_block_bytes(type), cpb = chunks_per_block(type);
    if (!bytes || K % (32 * cpb)) return -1;
    const int64_t nb = K / 32;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const uint8_t *wr = w + (ids ? ids[r] : r) * (nb / cpb) * bytes;
        for (int64_t b = 0; b < nb; b++) {
            f32x16 lo, hi;
            const uint8_t *block = wr + b / cpb * bytes;
            const int c = (int)(b % cpb);
            switch (type) {
            case Q4_1: dequant_chunk(Q4_1, block, c, &lo, &hi); break;
            case Q4_0: dequant_chunk(Q4_0, block, c, &lo, &hi); break;
            case Q8_0: dequant_chunk(Q8_0, block, c, &lo, &hi); break;
            case Q4_K: dequant_chunk(Q4_K, block, c, &lo, &hi); break;
            case Q5_K: dequant_chunk(Q5_K, block, c, &lo, &hi); break;
            default: dequant_chunk(Q6_K, block, c, &lo, &hi); break;
            }
            memcpy(out + r * K + b * 32, &lo, 64);
            memcpy(out + r * K + b * 32 + 16, &hi, 64);
        }
    }
    return 0;
}
