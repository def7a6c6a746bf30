/* A decode step's decoder layers in one call on the CPU: for a batch of one-token requests, each
 * layer's RMSNorm, fused q/k/v product over GGML blocks, optional q/k RMSNorm (Qwen3), rotary
 * embedding (Su et al., RoFormer, §3.4), K/V write into the paged cache, paged attention
 * (cpu_attention.c), output product, residual, RMSNorm, fused gate/up product, SiLU(gate) * up
 * (SwiGLU, Shazeer 2020), down product and residual.
 *
 * Why: at one to a few rows the products are a few hundred microseconds each, and the torch path
 * around them spends as long again in ~45 small operator calls per layer (norms, rotary halves,
 * slices, the K/V index copy), each a dispatch for a few KB of work. Here the element-wise work
 * runs on the calling thread between the products' OpenMP regions.
 *
 * Same arithmetic as the torch path (server/models/layers.py) up to summation order in the norms'
 * mean; with -ffp-contract=off the rotary embedding (q * cos + rotate_half(q) * sin) and the
 * residual adds round exactly as torch's element-wise operators do. The products and attention
 * are the very functions the torch path calls. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int ggml_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t M, float *y, int threads);
int paged_decode_attention(const float *query, const int64_t *q_rows, const float *k_cache, const float *v_cache,
                           const int32_t *tables, int64_t stride, const int32_t *seq_lens, int64_t n, int H, int KVH,
                           int D, int bs, float scale, int64_t window, float softcap, float *out, int threads);

/* One layer's weights. Products: GGML blocks of `*_type` (ggml_cpu.c); norms: fp32 [hidden]
 * (q_norm, k_norm: [D], NULL when the model has none); qkv_bias: fp32 [(H + 2 KVH) D] or NULL;
 * window: keys visible to a new token, itself included (0: all). Mirrored by ctypes in
 * cpu_decode.py: keep the field order. */
typedef struct {
    const uint8_t *qkv, *o, *gate_up, *down;
    int32_t qkv_type, o_type, gate_up_type, down_type;
    const float *qkv_bias, *input_norm, *post_norm, *q_norm, *k_norm;
    int64_t window;
} decode_layer;

/* out[i] = w[i] * (x[i] * rsqrt(mean(x^2) + eps)), as RMSNorm.forward: the product by the
 * reciprocal root first, then by the weight. */
static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* x [heads, D] in place: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). */
static void rotary(float *x, int heads, int D, const float *cos, const float *sin) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++, x += D) {
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] + (-b) * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* x [M, hidden] fp32 in place: the residual stream through layers 0 .. L-1.
 *   kv_cache  [L, 2, blocks, bs, KVH, D] fp32, contiguous
 *   cos, sin  [M, D]       each row's rotary factors (cat(freqs, freqs) at its position)
 *   slots     [M] int64    cache slot of each row's new K/V (block * bs + offset); -1: padding
 *   tables    [M, stride] int32, seq_lens [M] int32: as paged_decode_attention's
 * Returns 0; -1 for bad shapes or an unknown block type; -2 when out of memory. */
int decode_layers(const decode_layer *layers, int L, int hidden, int H, int KVH, int D, int inter, float eps,
                  float scale, float *x, int64_t M, const float *cos, const float *sin, const int64_t *slots,
                  float *kv_cache, int64_t num_blocks, int bs, const int32_t *tables, int64_t stride,
                  const int32_t *seq_lens, int threads) {
    if (L <= 0 || M <= 0 || H <= 0 || KVH <= 0 || H % KVH || D % 2 || hidden % 32 || inter % 32 || (H * D) % 32)
        return -1;
    const int64_t qkv_n = (int64_t)(H + 2 * KVH) * D, q_n = (int64_t)H * D, kv_n = (int64_t)KVH * D;
    const int64_t layer_floats = 2 * num_blocks * bs * kv_n;
    float *buf = malloc(sizeof(float) * (size_t)(M * (hidden + qkv_n + q_n + q_n + 2 * (int64_t)inter + hidden)));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)M);
    if (!buf || !rows) {
        free(buf);
        free(rows);
        return -2;
    }
    float *h = buf, *qkv = h + M * hidden, *q = qkv + M * qkv_n, *att = q + M * q_n, *gu = att + M * q_n,
          *out = gu + M * 2 * inter;
    for (int64_t m = 0; m < M; m++) rows[m] = m;
    int status = 0;
    for (int l = 0; l < L && !status; l++) {
        const decode_layer *w = &layers[l];
        float *k_cache = kv_cache + l * layer_floats, *v_cache = k_cache + layer_floats / 2;
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * hidden, w->input_norm, hidden, eps, h + m * hidden);
        if ((status = ggml_matmul(w->qkv_type, w->qkv, qkv_n, hidden, h, M, qkv, threads))) break;
        for (int64_t m = 0; m < M; m++) {
            float *row = qkv + m * qkv_n, *k = row + q_n, *v = k + kv_n;
            if (w->qkv_bias)
                for (int64_t i = 0; i < qkv_n; i++) row[i] = row[i] + w->qkv_bias[i];
            if (w->q_norm) {
                for (int hd = 0; hd < H; hd++) rms_norm(row + hd * D, w->q_norm, D, eps, row + hd * D);
                for (int hd = 0; hd < KVH; hd++) rms_norm(k + hd * D, w->k_norm, D, eps, k + hd * D);
            }
            rotary(row, H, D, cos + m * D, sin + m * D);
            rotary(k, KVH, D, cos + m * D, sin + m * D);
            memcpy(q + m * q_n, row, sizeof(float) * (size_t)q_n);
            if (slots[m] >= 0) {
                memcpy(k_cache + slots[m] * kv_n, k, sizeof(float) * (size_t)kv_n);
                memcpy(v_cache + slots[m] * kv_n, v, sizeof(float) * (size_t)kv_n);
            }
        }
        if ((status = paged_decode_attention(q, rows, k_cache, v_cache, tables, stride, seq_lens, M, H, KVH, D, bs,
                                             scale, w->window, 0.0f, att, threads)))
            break;
        if ((status = ggml_matmul(w->o_type, w->o, hidden, q_n, att, M, out, threads))) break;
        for (int64_t i = 0; i < M * hidden; i++) x[i] = x[i] + out[i];
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * hidden, w->post_norm, hidden, eps, h + m * hidden);
        if ((status = ggml_matmul(w->gate_up_type, w->gate_up, 2 * (int64_t)inter, hidden, h, M, gu, threads))) break;
        for (int64_t m = 0; m < M; m++) {
            float *g = gu + m * 2 * inter, *u = g + inter, *a = gu + m * inter;  /* a over g: read before written */
            for (int i = 0; i < inter; i++) {
                const float s = g[i] / (1.0f + expf(-g[i]));
                a[i] = s * u[i];
            }
        }
        if ((status = ggml_matmul(w->down_type, w->down, hidden, inter, gu, M, out, threads))) break;
        for (int64_t i = 0; i < M * hidden; i++) x[i] = x[i] + out[i];
    }
    free(buf);
    free(rows);
    return status;
}
