/* Each instruction family's multiply-accumulate rate on one core, and one core's read bandwidth.
 *
 * A family's loop keeps ACCS independent accumulators in registers (12 hide a 4-6 cycle latency on two
 * ports) and issues nothing else but the loop's counter, so it runs at the family's issue rate: the
 * ceiling a kernel built on it can reach. Each returns the seconds `iters` rounds took (a round: one
 * instruction per accumulator), or -1 where the library was built without the family; the
 * accumulators' sum goes to `sink` so that no loop is optimised away. The VNNI families are compiled
 * with a target attribute (no ISA level includes them): the caller runs them only where /proc/cpuinfo
 * lists `avx512_vnni` / `avx_vnni`.
 */

#include <stdint.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define ACCS 12

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* vfmadd231ps ymm: 8 MACs. */
double peak_fma256(int64_t iters, float *sink) {
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[ACCS];
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
    for (int j = 0; j < ACCS; j++) acc[j] = _mm256_set1_ps((float)j);
    const double t0 = now_s();
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < ACCS; j++) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
    const double t = now_s() - t0;
    __m256 s = acc[0];
    for (int j = 1; j < ACCS; j++) s = _mm256_add_ps(s, acc[j]);
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    *sink = lanes[0];
    return t;
#else
    (void)iters, (void)sink;
    return -1.0;
#endif
}

/* vfmadd231ps zmm: 16 MACs. */
double peak_fma512(int64_t iters, float *sink) {
#if defined(__AVX512F__)
    __m512 acc[ACCS];
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
    for (int j = 0; j < ACCS; j++) acc[j] = _mm512_set1_ps((float)j);
    const double t0 = now_s();
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < ACCS; j++) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
    const double t = now_s() - t0;
    __m512 s = acc[0];
    for (int j = 1; j < ACCS; j++) s = _mm512_add_ps(s, acc[j]);
    *sink = _mm512_reduce_add_ps(s);
    return t;
#else
    (void)iters, (void)sink;
    return -1.0;
#endif
}

/* vdpbf16ps zmm: 16 lanes x 2 bfloat16 products = 32 MACs. */
double peak_dpbf16(int64_t iters, float *sink) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    __m512 acc[ACCS];
    const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.5f), _mm512_set1_ps(0.25f));
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.001f), _mm512_set1_ps(-0.001f));
    for (int j = 0; j < ACCS; j++) acc[j] = _mm512_set1_ps((float)j);
    const double t0 = now_s();
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < ACCS; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
    const double t = now_s() - t0;
    __m512 s = acc[0];
    for (int j = 1; j < ACCS; j++) s = _mm512_add_ps(s, acc[j]);
    *sink = _mm512_reduce_add_ps(s);
    return t;
#else
    (void)iters, (void)sink;
    return -1.0;
#endif
}

#if defined(__x86_64__) && defined(__AVX512F__)
/* acc += a . b in groups of 4 bytes, as inline assembly: through the intrinsics GCC 12 adds a register
 * move around every vpdpbusd, which the loop then measures too. */
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline __m512i dpbusd_zmm(__m512i acc, __m512i a,
                                                                                              __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* vpdpbusd zmm: 16 lanes x 4 u8*s8 products = 64 MACs. */
__attribute__((target("avx512f,avx512vnni"))) double peak_vnni512(int64_t iters, float *sink) {
    __m512i acc[ACCS];
    const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    for (int j = 0; j < ACCS; j++) acc[j] = _mm512_set1_epi32(j);
    const double t0 = now_s();
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < ACCS; j++) acc[j] = dpbusd_zmm(acc[j], a, b);
    const double t = now_s() - t0;
    __m512i s = acc[0];
    for (int j = 1; j < ACCS; j++) s = _mm512_add_epi32(s, acc[j]);
    *sink = (float)_mm512_reduce_add_epi32(s);
    return t;
}
#else
double peak_vnni512(int64_t iters, float *sink) {
    (void)iters, (void)sink;
    return -1.0;
}
#endif

#if defined(__x86_64__) && defined(__AVX2__)
/* The same for the VEX form ("x": ymm0-15; `%{vex%}` spells the {vex} prefix in a GCC template). */
__attribute__((target("avx2,avxvnni"), always_inline)) static inline __m256i dpbusd_ymm(__m256i acc, __m256i a,
                                                                                       __m256i b) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}

/* AVX-VNNI vpdpbusd ymm: 8 lanes x 4 = 32 MACs. */
__attribute__((target("avx2,avxvnni"))) double peak_vnni256(int64_t iters, float *sink) {
    __m256i acc[ACCS];
    const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    for (int j = 0; j < ACCS; j++) acc[j] = _mm256_set1_epi32(j);
    const double t0 = now_s();
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < ACCS; j++) acc[j] = dpbusd_ymm(acc[j], a, b);
    const double t = now_s() - t0;
    __m256i s = acc[0];
    for (int j = 1; j < ACCS; j++) s = _mm256_add_epi32(s, acc[j]);
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, s);
    *sink = (float)lanes[0];
    return t;
}
#else
double peak_vnni256(int64_t iters, float *sink) {
    (void)iters, (void)sink;
    return -1.0;
}
#endif

/* Seconds one thread takes to read `nbytes` (a multiple of 64) at `p`, 64 bytes a load, 8 sums. */
double peak_read(const uint8_t *p, int64_t nbytes, uint64_t *sink) {
    uint64_t sums[8] = {0};
    const double t0 = now_s();
    for (int64_t off = 0; off + 64 <= nbytes; off += 64) {
        uint64_t line[8];
        memcpy(line, p + off, 64);
        for (int j = 0; j < 8; j++) sums[j] += line[j];
    }
    const double t = now_s() - t0;
    uint64_t s = 0;
    for (int j = 0; j < 8; j++) s += sums[j];
    *sink = s;
    return t;
}
