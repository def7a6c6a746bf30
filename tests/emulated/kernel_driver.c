/* Runs one CPU-kernel library's products on inputs written by tests/test_cpu_isa.py under
 * qemu-user: the aarch64 paths (cross-compiled; Python cannot load them), and the x86-64 paths on
 * an emulated CPU without AVX-512 (Haswell) or without AVX (qemu64), where any instruction the
 * CPU lacks is SIGILL.
 *
 *   kernel_driver LIB.so IN OUT
 *   kernel_driver --features GENERIC_LIB.so     prints slipstream_cpu_features() of this CPU
 *
 * IN is a sequence of records, each an int32 op then its operands (little-endian, packed):
 *   1 dequantize: int32 type, int64 N, int64 K, uint8 blocks[N * row_bytes]         -> float [N, K]
 *   2 matmul:     int32 type, int64 N, int64 K, int64 M, blocks, float x[M, K]       -> float [M, N]
 *   3 attention:  int64 T, n, H, KVH, D, bs, blocks, stride, window; float scale, softcap;
 *                 float query[T, H, D], int64 q_rows[n], float k_cache[blocks, bs, KVH, D],
 *                 v_cache alike, int32 tables[n, stride], int32 seq_lens[n]           -> float [T, H, D]
 * OUT gets each record's result in order. Exit 0, or 1 with a message. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*block_bytes_fn)(int);
typedef int (*dequantize_fn)(int, const uint8_t *, int64_t, const int64_t *, int64_t, float *, int);
typedef int (*matmul_fn)(int, const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int);
typedef int (*attention_fn)(const float *, const int64_t *, const float *, const float *, const int32_t *, int64_t,
                            const int32_t *, int64_t, int, int, int, int, float, int64_t, float, float *, int);

static const uint8_t *cur, *end;

static const void *take(size_t n) {
    if ((size_t)(end - cur) < n) {
        fprintf(stderr, "input ends early\n");
        exit(1);
    }
    const void *p = cur;
    cur += n;
    return p;
}

#define TAKE(type) (*(const type *)take(sizeof(type)))

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "%s: %s\n", name, dlerror());
        exit(1);
    }
    return f;
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--features")) {
        void *generic = dlopen(argv[2], RTLD_NOW);
        if (!generic) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        printf("%d\n", ((int (*)(void))sym(generic, "slipstream_cpu_features"))());
        return 0;
    }
    if (argc != 4) {
        fprintf(stderr, "usage: %s LIB IN OUT | --features GENERIC_LIB\n", argv[0]);
        return 1;
    }
    void *lib = dlopen(argv[1], RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    block_bytes_fn block_bytes = (block_bytes_fn)sym(lib, "ggml_block_bytes");
    dequantize_fn dequantize = (dequantize_fn)sym(lib, "ggml_dequantize");
    matmul_fn matmul = (matmul_fn)sym(lib, "ggml_matmul");
    attention_fn attention = (attention_fn)sym(lib, "paged_decode_attention");
    FILE *in = fopen(argv[2], "rb"), *out = fopen(argv[3], "wb");
    if (!in || !out) {
        perror("open");
        return 1;
    }
    fseek(in, 0, SEEK_END);
    long size = ftell(in);
    fseek(in, 0, SEEK_SET);
    uint8_t *data = malloc((size_t)size);
    if (!data || fread(data, 1, (size_t)size, in) != (size_t)size) {
        perror("read");
        return 1;
    }
    cur = data;
    end = data + size;
    while (cur < end) {
        const int32_t op = TAKE(int32_t);
        int status = 0;
        float *result;
        size_t count;
        if (op == 1 || op == 2) {
            const int32_t type = TAKE(int32_t);
            const int64_t N = TAKE(int64_t), K = TAKE(int64_t), M = op == 2 ? TAKE(int64_t) : 0;
            const int chunk = type >= 12 ? 256 : 32;
            const uint8_t *blocks = take((size_t)(N * (K / chunk) * block_bytes(type)));
            count = (size_t)(op == 1 ? N * K : M * N);
            result = malloc(sizeof(float) * count);
            if (op == 1) status = dequantize(type, blocks, K, NULL, N, result, 2);
            else status = matmul(type, blocks, N, K, take(sizeof(float) * (size_t)(M * K)), M, result, 2);
        } else if (op == 3) {
            const int64_t T = TAKE(int64_t), n = TAKE(int64_t), H = TAKE(int64_t), KVH = TAKE(int64_t),
                          D = TAKE(int64_t), bs = TAKE(int64_t), nblocks = TAKE(int64_t), stride = TAKE(int64_t),
                          window = TAKE(int64_t);
            const float scale = TAKE(float), softcap = TAKE(float);
            const float *query = take(sizeof(float) * (size_t)(T * H * D));
            const int64_t *q_rows = take(sizeof(int64_t) * (size_t)n);
            const size_t cache = sizeof(float) * (size_t)(nblocks * bs * KVH * D);
            const float *k_cache = take(cache), *v_cache = take(cache);
            const int32_t *tables = take(sizeof(int32_t) * (size_t)(n * stride));
            const int32_t *seq_lens = take(sizeof(int32_t) * (size_t)n);
            count = (size_t)(T * H * D);
            result = calloc(count, sizeof(float));
            status = attention(query, q_rows, k_cache, v_cache, tables, stride, seq_lens, n, (int)H, (int)KVH,
                               (int)D, (int)bs, scale, window, softcap, result, 2);
        } else {
            fprintf(stderr, "unknown op %d\n", op);
            return 1;
        }
        if (status) {
            fprintf(stderr, "op %d returned %d\n", op, status);
            return 1;
        }
        fwrite(result, sizeof(float), count, out);
        free(result);
    }
    fclose(out);
    return 0;
}
