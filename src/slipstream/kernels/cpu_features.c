/* What the running CPU can execute, asked of the CPU itself (CPUID and XGETBV on x86-64 through
 * the compiler's runtime, the kernel's hwcaps on aarch64). Built into the generic library only,
 * with the architecture's baseline flags, so it runs on every CPU of that architecture; the
 * loader (cpu_native.py) calls it before it loads a faster path's library. */
#include <stdint.h>
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif

enum { ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_NEON = 4 }; /* bits; cpu_native.py: FEATURE_BITS */

int slipstream_cpu_features(void) {
    int bits = 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    /* libgcc sets an AVX feature only where the OS saves the registers it needs (XCR0). */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        bits |= ISA_AVX2;
    if ((bits & ISA_AVX2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        bits |= ISA_AVX512;
#elif defined(__aarch64__)
    if (getauxval(AT_HWCAP) & (1UL << 1)) bits |= ISA_NEON; /* HWCAP_ASIMD */
#endif
    return bits;
}
