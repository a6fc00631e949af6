/* Scalar helpers shared by the CPU kernels: bfloat16 <-> float32, a vectorisable exp, and the
 * size of a thread team for a loop over rows.
 *
 * Everything is plain arithmetic and bit moves, so loops calling these
 * (under `#pragma omp simd`) compile to SIMD code; libm's expf would be a
 * scalar call per element.
 */

#ifndef ASYNCPP_CPU_MATH_H
#define ASYNCPP_CPU_MATH_H

#include <stdint.h>
#include <string.h>

static inline float widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) { /* nearest, ties to even, as torch; NaN stays a quiet NaN */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float round_bf16(float f) { return widen(narrow(f)); }

/* IEEE half -> float32, exactly (normals, subnormals, infinities, NaN): the generic path of F16C's vcvtph2ps. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000 | (mant << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    } else { /* zero or subnormal: mant * 2^-24, exact in float32 */
        float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* exp(x) = 2^n * e^r, n = rint(x * log2 e), r = x - n ln2 (ln2 in two parts) with |r| <= ln2/2, and
 * e^r by a Cephes polynomial. Macros, so that a float and a vector of floats (cpu_vec.h) run the
 * same operations in the same order (contraction is off: -std=c11) and give the same bits. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_REDUCE(x, n) ((x) - (n) * 0.693145751953125f - (n) * 1.428606765330187e-06f)
#define EXP_POLY(r)                                                                                             \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) + \
       1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

/* exp(x) for x <= 0 (EXP_*), relative error ~2e-7. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_rintf(x * EXP_LOG2E);
    const float r = EXP_REDUCE(x, n);
    const float p = EXP_POLY(r);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Threads for a loop over `rows` independent rows: one per `min_rows` rows (below that, waking a
 * thread costs more than it saves), at least one, at most `num_threads`. */
static inline int team_size(int64_t rows, int64_t min_rows, int num_threads) {
    const int64_t useful = rows / min_rows;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

#endif
