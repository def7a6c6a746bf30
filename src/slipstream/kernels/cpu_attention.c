/* Decode attention over the paged KV cache on the CPU, fp32, reading each request's K/V in place
 * through its block table (PagedAttention, Kwon et al. SOSP '23, §4.1) instead of gathering
 * whole contexts first. One query token per request; grouped-query attention shares a KV head
 * between num_heads / num_kv_heads query heads, whose scores are computed in one pass over the
 * context so each K and V row is read once. Softmax in fp32: max, exp, sum, then the weighted
 * sum of V. A sliding window (Longformer, Beltagy et al. 2020, §3.1; Mistral 7B, Jiang et al.
 * 2023, §2) visits only the last `window` keys; a soft-cap maps each scaled score s to
 * softcap * tanh(s / softcap) (Gemma 2, Gemma Team 2024, §2). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

static inline float dot(const float *a, const float *b, int n) {
    if (n % VL == 0) {
        vf acc = vsplat(0.0f);
        for (int i = 0; i < n; i += VL) acc += vload(a + i) * vload(b + i);
        return vhsum(acc);
    }
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[q_rows[i], h, :] for decode request i of n:
 *   query   [T, H, D]            rows q_rows[i]
 *   k_cache [blocks, bs, KVH, D] and v_cache alike
 *   tables  [n, stride] int32    the requests' block tables (this step's rows)
 *   seq_lens [n] int32           context length including the new token
 *   window                       keys visible to the new token (itself included); 0: all
 *   softcap                      attention logit soft-cap; 0: none
 * Returns 0, -1 for bad shapes, -2 when out of memory. */
int paged_decode_attention(const float *query, const int64_t *q_rows, const float *k_cache, const float *v_cache,
                           const int32_t *tables, int64_t stride, const int32_t *seq_lens, int64_t n, int H, int KVH,
                           int D, int bs, float scale, int64_t window, float softcap, float *out, int threads) {
    if (KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || window < 0 || softcap < 0.0f) return -1;
    const int G = H / KVH;
    int status = 0;
    #pragma omp parallel for collapse(2) num_threads(threads) schedule(dynamic)
    for (int64_t i = 0; i < n; i++) {
        for (int kh = 0; kh < KVH; kh++) {
            const int64_t start = window && seq_lens[i] > window ? seq_lens[i] - window : 0;
            const int64_t L = seq_lens[i] - start;  /* keys start .. seq_lens[i] - 1, p[t] for key start + t */
            float *p = malloc(sizeof(float) * (size_t)(G * L + G * D + 2 * G));
            if (!p) { status = -2; continue; }
            float *acc = p + G * L, *mx = acc + G * D, *sum = mx + G;
            const float *q = query + (q_rows[i] * H + (int64_t)kh * G) * D;  /* G heads, contiguous */
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;
            for (int64_t t = 0; t < L; t++) {
                const int64_t j = start + t;
                const int64_t slot = (int64_t)tables[i * stride + j / bs] * bs + j % bs;
                const float *k = k_cache + (slot * KVH + kh) * D;
                for (int g = 0; g < G; g++) {
                    float s = dot(q + g * D, k, D) * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    p[g * L + t] = s;
                    if (s > mx[g]) mx[g] = s;
                }
            }
            for (int g = 0; g < G; g++) {
                float total = 0.0f;
                for (int64_t t = 0; t < L; t++) total += (p[g * L + t] = expf(p[g * L + t] - mx[g]));
                sum[g] = total;
            }
            memset(acc, 0, sizeof(float) * (size_t)(G * D));
            for (int64_t t = 0; t < L; t++) {
                const int64_t j = start + t;
                const int64_t slot = (int64_t)tables[i * stride + j / bs] * bs + j % bs;
                const float *v = v_cache + (slot * KVH + kh) * D;
                for (int g = 0; g < G; g++) {
                    const float w = p[g * L + t];
                    float *a = acc + g * D;
                    for (int d = 0; d < D; d++) a[d] += w * v[d];
                }
            }
            for (int g = 0; g < G; g++) {
                float *o = out + (q_rows[i] * H + (int64_t)kh * G + g) * D;
                for (int d = 0; d < D; d++) o[d] = acc[g * D + d] / sum[g];
            }
            free(p);
        }
    }
    return status;
}
