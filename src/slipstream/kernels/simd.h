/* The vector primitives of the CPU kernels, one set per instruction set.
 *
 * Each kernel library is built once per path (cpu_build.py: VARIANTS) with exactly one of
 *   SLIPSTREAM_ISA_AVX512   x86-64 AVX-512 F/BW/DQ/VL + FMA + F16C   16 lanes
 *   SLIPSTREAM_ISA_AVX2     x86-64 AVX2 + FMA + F16C                 8 lanes
 *   SLIPSTREAM_ISA_NEON     ARMv8-A Advanced SIMD (every aarch64)    4 lanes
 *   SLIPSTREAM_ISA_GENERIC  plain C the compiler vectorizes for the architecture's baseline
 * defined, and the flags that path needs; the library for the running CPU is chosen when it
 * loads (cpu_native.py), never by -march=native of the machine that built it.
 *
 * vf holds VL floats in the ISA's natural register width (wider GCC vectors than the registers
 * are split and, for conversions from bytes, scalarized). A chunk of 32 weights is 32 / VL of
 * them; the kernels compute each weight as the gguf package does (one fp32 multiply, then one
 * add: the library is built with -ffp-contract=off), so only summation order differs per path. */
#ifndef SLIPSTREAM_SIMD_H
#define SLIPSTREAM_SIMD_H
#include <stdint.h>
#include <string.h>

#if defined(SLIPSTREAM_ISA_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__FMA__)
#error "SLIPSTREAM_ISA_AVX512 needs -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c"
#endif
#include <immintrin.h>
#define VL 16
#define SLIPSTREAM_ISA_NAME "avx512"
#elif defined(SLIPSTREAM_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "SLIPSTREAM_ISA_AVX2 needs -mavx2 -mfma -mf16c"
#endif
#include <immintrin.h>
#define VL 8
#define SLIPSTREAM_ISA_NAME "avx2"
#elif defined(SLIPSTREAM_ISA_NEON)
#if !defined(__ARM_NEON) || !defined(__aarch64__)
#error "SLIPSTREAM_ISA_NEON needs an aarch64 compiler"
#endif
#include <arm_neon.h>
#define VL 4
#define SLIPSTREAM_ISA_NAME "neon"
#elif defined(SLIPSTREAM_ISA_GENERIC)
#define VL 4
#define SLIPSTREAM_ISA_NAME "generic"
#else
#error "define one SLIPSTREAM_ISA_* (see simd.h)"
#endif

#define NV (16 / VL) /* vectors per 16 weights: half a chunk */

typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf vsplat(float s) {
#if defined(SLIPSTREAM_ISA_AVX512)
    return (vf)_mm512_set1_ps(s);
#elif defined(SLIPSTREAM_ISA_AVX2)
    return (vf)_mm256_set1_ps(s);
#elif defined(SLIPSTREAM_ISA_NEON)
    return (vf)vdupq_n_f32(s);
#else
    vf v;
    for (int i = 0; i < VL; i++) v[i] = s;
    return v;
#endif
}

/* a * b + c: fused where the ISA has it (the dot product's rounding, never a dequantization's). */
static inline vf vfma(vf a, vf b, vf c) {
#if defined(SLIPSTREAM_ISA_AVX512)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(SLIPSTREAM_ISA_AVX2)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(SLIPSTREAM_ISA_NEON)
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
#endif
}

static inline float vhsum(vf v) {
#if defined(SLIPSTREAM_ISA_AVX512)
    return _mm512_reduce_add_ps((__m512)v);
#elif defined(SLIPSTREAM_ISA_AVX2)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#elif defined(SLIPSTREAM_ISA_NEON)
    return vaddvq_f32((float32x4_t)v);
#else
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
#endif
}

/* 16 unsigned / signed bytes -> 16 floats in out[0 .. NV-1], exactly. */
static inline void cvt_u8(u8x16 q, vf *out) {
#if defined(SLIPSTREAM_ISA_AVX512)
    out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)q));
#elif defined(SLIPSTREAM_ISA_AVX2)
    out[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32((__m128i)q));
    out[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128((__m128i)q, 8)));
#elif defined(SLIPSTREAM_ISA_NEON)
    const uint16x8_t lo = vmovl_u8(vget_low_u8((uint8x16_t)q)), hi = vmovl_high_u8((uint8x16_t)q);
    out[0] = (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
    out[1] = (vf)vcvtq_f32_u32(vmovl_high_u16(lo));
    out[2] = (vf)vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
    out[3] = (vf)vcvtq_f32_u32(vmovl_high_u16(hi));
#else /* through arrays: GCC vectorizes the loop, not element reads of a vector */
    uint8_t b[16];
    float f[16];
    memcpy(b, &q, 16);
    for (int i = 0; i < 16; i++) f[i] = (float)b[i];
    memcpy(out, f, sizeof f);
#endif
}

static inline void cvt_i8(i8x16 q, vf *out) {
#if defined(SLIPSTREAM_ISA_AVX512)
    out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)q));
#elif defined(SLIPSTREAM_ISA_AVX2)
    out[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32((__m128i)q));
    out[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128((__m128i)q, 8)));
#elif defined(SLIPSTREAM_ISA_NEON)
    const int16x8_t lo = vmovl_s8(vget_low_s8((int8x16_t)q)), hi = vmovl_high_s8((int8x16_t)q);
    out[0] = (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    out[1] = (vf)vcvtq_f32_s32(vmovl_high_s16(lo));
    out[2] = (vf)vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    out[3] = (vf)vcvtq_f32_s32(vmovl_high_s16(hi));
#else
    int8_t b[16];
    float f[16];
    memcpy(b, &q, 16);
    for (int i = 0; i < 16; i++) f[i] = (float)b[i];
    memcpy(out, f, sizeof f);
#endif
}

/* An fp16 value as stored (little-endian), widened exactly. */
static inline float fp16(const uint8_t *p) {
#if defined(SLIPSTREAM_ISA_AVX2) || defined(SLIPSTREAM_ISA_AVX512)
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
#elif defined(__FLT16_MAX__) /* the compiler has _Float16 (GCC 12+, Clang 15+ on x86-64 and aarch64) */
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
#else /* IEEE binary16 by hand: every value, subnormals and NaN payloads included, is exact in fp32 */
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8, sign = (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 31, man = h & 0x3ffu, bits;
    if (exp == 31) bits = sign | 0x7f800000u | man << 13;
    else if (exp) bits = sign | (exp + 112) << 23 | man << 13;
    else if (!man) bits = sign;
    else { /* subnormal: normalize */
        exp = 113;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | exp << 23 | (man & 0x3ffu) << 13;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#endif
