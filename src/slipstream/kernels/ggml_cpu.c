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
 * The vector primitives come from simd.h, once per instruction set; AVX-512 also gathers 4-bit
 * weights from a table of their 16 possible values (vpermps), fewer operations than per weight. */
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 }; /* GGML type ids, as gguf.GGMLQuantizationType */
#define PREFETCH_BLOCKS 16             /* chunks ahead of the one being read: ~320 bytes */
#define MAX_ROWS 8                     /* activation rows per pass over a weight row */
#define CV (2 * NV)                    /* vectors per chunk of 32 weights */

/* The path this library was built for (cpu_native.py checks it after loading). */
const char *slipstream_cpu_isa(void) { return SLIPSTREAM_ISA_NAME; }

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

#ifdef SLIPSTREAM_ISA_AVX512
/* An fp16 scale in all 16 lanes as a vector conversion: a scalar one merges into its
 * destination, which chains every block's conversion to the previous one. */
static inline vf fp16x16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return (vf)_mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}
#define SPLAT_FP16(p) fp16x16(p)
#else
#define SPLAT_FP16(p) vsplat(fp16(p))
#endif

/* The block's 32 weights into w[0 .. CV-1]. `type` is a constant at every call site. */
static inline __attribute__((always_inline)) void dequant_block(int type, const uint8_t *b, vf *w) {
    const vf d = SPLAT_FP16(b);
    if (type == Q8_0) {
        i8x16 q0, q1;
        memcpy(&q0, b + 2, 16);
        memcpy(&q1, b + 18, 16);
        cvt_i8(q0, w);
        cvt_i8(q1, w + NV);
        for (int i = 0; i < CV; i++) w[i] = w[i] * d;
        return;
    }
    u8x16 q;
    memcpy(&q, b + (type == Q4_1 ? 4 : 2), 16);
#ifdef SLIPSTREAM_ISA_AVX512
    /* A 4-bit weight takes one of 16 values: compute those (same multiply and add, so the same
     * roundings) and gather the block's weights from them. */
    const vf nibbles = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    vf table;
    if (type == Q4_1) { /* d and m side by side: one conversion of both, then each in all lanes */
        uint32_t dm;
        memcpy(&dm, b, 4);
        const __m512 both = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)dm)));
        const vf dv = (vf)_mm512_permutexvar_ps(_mm512_setzero_si512(), both);
        const vf mv = (vf)_mm512_permutexvar_ps(_mm512_set1_epi32(1), both);
        table = nibbles * dv + mv;
    } else {
        table = (nibbles - 8) * d;
    }
    /* vpermps reads only the low 4 bits of each index: the widened bytes index the low nibbles as
     * they are, and shifted right by 4 the high ones (no masking of the bytes first). */
    const __m512i bytes = _mm512_cvtepu8_epi32((__m128i)q);
    w[0] = (vf)_mm512_permutexvar_ps(bytes, (__m512)table);
    w[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), (__m512)table);
#else
    if (type == Q4_1) {
        const vf m = SPLAT_FP16(b + 2);
        cvt_u8(q & 15, w);
        cvt_u8(q >> 4, w + NV);
        for (int i = 0; i < CV; i++) w[i] = w[i] * d + m;
    } else {
        cvt_i8((i8x16)(q & 15) - 8, w);
        cvt_i8((i8x16)(q >> 4) - 8, w + NV);
        for (int i = 0; i < CV; i++) w[i] = w[i] * d;
    }
#endif
}

/* 16 bytes shifted as 8 lanes of 16 bits: the bits that cross a byte boundary are the caller's
 * to mask. n is a constant at every call; a shift by 0 is the bytes as they are. */
typedef uint16_t u16x8 __attribute__((vector_size(16)));
static inline u8x16 shl16(u8x16 v, int n) { return (u8x16)((u16x8)v << n); }
static inline u8x16 shr16(u8x16 v, int n) { return (u8x16)((u16x8)v >> n); }

/* Q6_K: 16 weights as the bytes 4 (q - 32), from their low nibbles (bits lshift..lshift+3 of l)
 * and high pairs (bits hshift, hshift+1 of h): the nibble in bits 2-5, the pair in 6-7 with its
 * top bit flipped (^ 0x80 is - 4 * 32), so the byte is signed as q - 32 is. */
static inline i8x16 q6_times4(u8x16 l, u8x16 h, int lshift, int hshift) {
    const u8x16 nibble = (lshift ? shr16(l, 2) : shl16(l, 2)) & 0x3c;
    return (i8x16)(((shl16(h, 6 - hshift) & 0xc0) | nibble) ^ 0x80);
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

/* Sub-block c (0-7) of a K-quant super-block `b`: weights 32c .. 32c+31 into w[0 .. CV-1].
 * Scales are multiplied as the gguf package does: d * sc and dmin * m first, each rounded. */
static inline __attribute__((always_inline)) void dequant_k_chunk(int type, const uint8_t *b, int c, vf *w) {
    if (type == Q6_K) {
        /* Each weight as 4 (q - 32) in a byte (q6_times4): each field moved into place by one shift
         * of 16-bit lanes (x86 has no byte shift; GCC built the old byte << 4 from four adds). The
         * scale carries the 1/4, a power of two: (4a) * (s / 4) rounds as a * s, bit for bit. */
        const uint8_t *ql = b + 64 * (c / 4) + 32 * (c % 2), *qh = b + 128 + 32 * (c / 4);
        const int lshift = 4 * ((c / 2) % 2), hshift = 2 * (c % 4);
        const float d = fp16(b + 208) * 0.25f;
        u8x16 l0, l1, h0, h1;
        memcpy(&l0, ql, 16);
        memcpy(&l1, ql + 16, 16);
        memcpy(&h0, qh, 16);
        memcpy(&h1, qh + 16, 16);
        cvt_i8(q6_times4(l0, h0, lshift, hshift), w);
        cvt_i8(q6_times4(l1, h1, lshift, hshift), w + NV);
        const vf s0 = vsplat(d * (float)(int8_t)b[192 + 2 * c]), s1 = vsplat(d * (float)(int8_t)b[192 + 2 * c + 1]);
        for (int i = 0; i < NV; i++) {
            w[i] = w[i] * s0;
            w[NV + i] = w[NV + i] * s1;
        }
        return;
    }
    uint8_t sc, m;
    scale_min_k4(b + 4, c, &sc, &m);
    const uint8_t *qs = b + (type == Q5_K ? 48 : 16) + 32 * (c / 2);
    const int shift = 4 * (c % 2);
    u8x16 q0, q1;
    memcpy(&q0, qs, 16);
    memcpy(&q1, qs + 16, 16);
#ifdef SLIPSTREAM_ISA_AVX512
    /* As dequant_block: the 16 (Q4_K) or 32 (Q5_K) values a weight can take, computed with the
     * same multiply and subtract, then gathered by index (vpermps reads 4 index bits, vpermi2ps 5). */
    const vf dsc_v = fp16x16(b) * (float)sc, dm_v = fp16x16(b + 2) * (float)m;
    const vf nibbles = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const __m512 t0 = (__m512)(nibbles * dsc_v - dm_v);
    if (type == Q4_K) {
        __m512i i0 = _mm512_cvtepu8_epi32((__m128i)q0), i1 = _mm512_cvtepu8_epi32((__m128i)q1);
        if (shift) {
            i0 = _mm512_srli_epi32(i0, 4);
            i1 = _mm512_srli_epi32(i1, 4);
        }
        w[0] = (vf)_mm512_permutexvar_ps(i0, t0);
        w[1] = (vf)_mm512_permutexvar_ps(i1, t0);
        return;
    }
    const __m512 t1 = (__m512)((nibbles + 16) * dsc_v - dm_v);
    /* index = the nibble, plus 16 where bit c of the weight's high byte is set: the nibble masked
     * and the bit tested in bytes (vptestmb gives the 16 lanes' mask at once), then widened. */
    u8x16 h0, h1;
    memcpy(&h0, b + 16, 16);
    memcpy(&h1, b + 32, 16);
    const __m128i bit = _mm_set1_epi8((char)(1 << c)), fifteen = _mm_set1_epi8(15), sixteen = _mm_set1_epi8(16);
    const __m128i n0 = _mm_and_si128(shift ? _mm_srli_epi16((__m128i)q0, 4) : (__m128i)q0, fifteen);
    const __m128i n1 = _mm_and_si128(shift ? _mm_srli_epi16((__m128i)q1, 4) : (__m128i)q1, fifteen);
    const __m128i x0 = _mm_mask_add_epi8(n0, _mm_test_epi8_mask((__m128i)h0, bit), n0, sixteen);
    const __m128i x1 = _mm_mask_add_epi8(n1, _mm_test_epi8_mask((__m128i)h1, bit), n1, sixteen);
    w[0] = (vf)_mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(x0), t1);
    w[1] = (vf)_mm512_permutex2var_ps(t0, _mm512_cvtepu8_epi32(x1), t1);
#else
    const vf dsc = vsplat(fp16(b) * (float)sc), dm = vsplat(fp16(b + 2) * (float)m);
    q0 = (q0 >> shift) & 15;
    q1 = (q1 >> shift) & 15;
    if (type == Q5_K) {
        /* bit c of byte l is weight l's fifth bit: 16 where it is set, by a byte compare (x86 has
         * no byte shift; GCC built the old `((h >> c) & 1) << 4` from four adds) */
        u8x16 h0, h1;
        memcpy(&h0, b + 16, 16);
        memcpy(&h1, b + 32, 16);
        q0 |= (u8x16)((h0 & (uint8_t)(1 << c)) != 0) & 16;
        q1 |= (u8x16)((h1 & (uint8_t)(1 << c)) != 0) & 16;
    }
    cvt_u8(q0, w);
    cvt_u8(q1, w + NV);
    for (int i = 0; i < CV; i++) w[i] = w[i] * dsc - dm;
#endif
}

/* Chunk c of block b: the one place that knows both layouts. `type` is a constant at every call. */
static inline __attribute__((always_inline)) void dequant_chunk(int type, const uint8_t *b, int c, vf *w) {
    if (chunks_per_block(type) == 1) dequant_block(type, b, w);
    else dequant_k_chunk(type, b, c, w);
}

/* y[r, j] for `nr` weight rows (w, w + row_bytes, ...) against `rows` rows of x, every weight
 * dequantized once for all of them. `type`, `nr` and `rows` are constants at each call, so the
 * accumulators (nr * rows vectors) stay in registers; x is read from L1 by the FMAs. */
static inline __attribute__((always_inline)) void dot_tile(int type, int nr, int rows, const uint8_t *w,
                                                           int64_t row_bytes, int64_t nb, int bytes,
                                                           const float *x, int64_t K, float *y, int64_t N) {
    const int cpb = chunks_per_block(type);
    vf acc[4][MAX_ROWS];
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = vsplat(0.0f);
    /* bb: a block. On AVX2/AVX-512 its chunks are unrolled so each c is a constant (a K-quant's
     * shifts by c are then immediates, not per-byte variable shifts); the generic path keeps the
     * loop, which builds 4x faster, as a fallback should. */
    for (int64_t bb = 0; bb < nb / cpb; bb++) {
#if VL >= 8
#pragma GCC unroll 8
#endif
        for (int c = 0; c < cpb; c++) {
            const int64_t b = bb * cpb + c; /* chunk of 32 weights */
            for (int j = 0; j < nr; j++) {
                vf wv[CV];
                const uint8_t *block = w + j * row_bytes + bb * bytes;
                __builtin_prefetch(w + j * row_bytes + (b + PREFETCH_BLOCKS) * bytes / cpb);
                dequant_chunk(type, block, c, wv);
                for (int r = 0; r < rows; r++)
                    for (int i = 0; i < CV; i++) acc[j][r] = vfma(wv[i], vload(x + r * K + b * 32 + i * VL), acc[j][r]);
            }
        }
    }
    for (int j = 0; j < nr; j++)
        for (int r = 0; r < rows; r++) y[r * N + j] = vhsum(acc[j][r]);
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

/* One function per type, each type's tiles compiled apart from the others'. Inlined all into
 * ggml_matmul's one OpenMP body, as they were until 2026-12-07, Q4_K and Q5_K took 1.4-1.9x as
 * long on an AVX2-only Zen 3 (benchmarks/README.md, "Quantized products on CPU"); no type got slower. */
#define TYPE_TILES(T)                                                                          \
    static __attribute__((noinline)) void tiles_##T(int nr, int rows, const uint8_t *wn, int64_t row_bytes, \
                                                    int64_t nb, int bytes, const float *xm, int64_t K,      \
                                                    float *ym, int64_t N) { TILES(T) }
TYPE_TILES(Q4_0) TYPE_TILES(Q4_1) TYPE_TILES(Q8_0) TYPE_TILES(Q4_K) TYPE_TILES(Q5_K) TYPE_TILES(Q6_K)

#define TILE_ARGS nr, rows, wn, row_bytes, nb, bytes, xm, K, ym, N
#define ALL_TYPES                                                                             \
    switch (type) {                                                                           \
    case Q4_1: tiles_Q4_1(TILE_ARGS); break; case Q4_0: tiles_Q4_0(TILE_ARGS); break;         \
    case Q8_0: tiles_Q8_0(TILE_ARGS); break; case Q4_K: tiles_Q4_K(TILE_ARGS); break;         \
    case Q5_K: tiles_Q5_K(TILE_ARGS); break; default: tiles_Q6_K(TILE_ARGS); break;           \
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
            vf wv[CV];
            const uint8_t *block = wr + b / cpb * bytes;
            const int c = (int)(b % cpb);
            switch (type) {
            case Q4_1: dequant_chunk(Q4_1, block, c, wv); break;
            case Q4_0: dequant_chunk(Q4_0, block, c, wv); break;
            case Q8_0: dequant_chunk(Q8_0, block, c, wv); break;
            case Q4_K: dequant_chunk(Q4_K, block, c, wv); break;
            case Q5_K: dequant_chunk(Q5_K, block, c, wv); break;
            default: dequant_chunk(Q6_K, block, c, wv); break;
            }
            memcpy(out + r * K + b * 32, wv, sizeof wv);
        }
    }
    return 0;
}
