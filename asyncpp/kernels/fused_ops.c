/* Fused elementwise ops for the Llama layer on CPU, one pass each, in bfloat16 and float32.
 *
 * The bfloat16 ops reproduce the roundings of the unfused bfloat16 torch code
 * they replace (every intermediate torch would store is rounded to bfloat16
 * here too), so only the order of a float32 sum can differ. Rows are
 * independent and computed in a fixed order: results never depend on the batch.
 *
 *   add_rms_norm: residual_out = residual + x (or x); out = w * bf16(r * rsqrt(mean(r^2) + eps))
 *   silu_mul:     out = bf16(silu(gate)) * up, gate_up = [gate | up] per row
 *   rope:         x = bf16(x * cos) + bf16(rotate_half(x) * sin) in place, per head
 *
 * The float32 ops compute the same expressions with float32 roundings, each
 * product and sum rounded where torch rounds it (-std=c11 turns off FMA
 * contraction): residual_out and rope are bit-identical to torch; the norm
 * differs only through 1 / rms (from a double sum of squares, see below),
 * silu_mul only through exp (~2e-7 relative).
 */

#include <math.h>
#include <stdint.h>

#include "cpu_math.h"
#include "cpu_vec.h"

/* RoPE's largest head (fused_ops.py checks it: MAX_ROPE_HEAD_DIM). */
#define MAX_ROPE_HEAD_DIM 512

/* Below this many rows a step is one thread's work: waking a team costs more. */
#define MIN_ROWS_PER_THREAD 16

void add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *residual_out,
                       uint16_t *out, int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *xi = x + i * dim;
        uint16_t *ri = residual_out + i * dim, *oi = out + i * dim;
        float sum_sq = 0.0f;
        if (residual != NULL) {
            const uint16_t *res = residual + i * dim;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < dim; j++) {
                const uint16_t r = narrow(widen(res[j]) + widen(xi[j]));
                ri[j] = r;
                sum_sq += widen(r) * widen(r);
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < dim; j++) {
                ri[j] = xi[j];
                sum_sq += widen(xi[j]) * widen(xi[j]);
            }
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)dim + eps);
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) oi[j] = narrow(widen(weight[j]) * round_bf16(widen(ri[j]) * inv_rms));
    }
}

/* x: [rows, num_heads, head_dim] with a row stride; cos/sin: [max_position, head_dim] float32.
 * cos and sin are rounded to bfloat16 once per row (every head takes the same), as the torch code
 * casts them before it multiplies. Iteration j reads and writes only elements j and j + half. */
void rope_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *cos_row = cos_table + positions[i] * head_dim, *sin_row = sin_table + positions[i] * head_dim;
        float c[MAX_ROPE_HEAD_DIM], s[MAX_ROPE_HEAD_DIM];
#pragma omp simd
        for (int64_t j = 0; j < head_dim; j++) {
            c[j] = round_bf16(cos_row[j]);
            s[j] = round_bf16(sin_row[j]);
        }
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *xh = x + i * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                /* rotate_half(x) = [-hi, lo] */
                const float lo = widen(xh[j]), hi = widen(xh[j + half]);
                xh[j] = narrow(round_bf16(lo * c[j]) + round_bf16(-hi * s[j]));
                xh[j + half] = narrow(round_bf16(hi * c[j + half]) + round_bf16(lo * s[j + half]));
            }
        }
    }
}

/* float32 rows: residual_out = x + residual (or x); out = w * (r * (1 / sqrt(mean(r^2) + eps))).
 * Squares are summed in double: each float32 square is exact there and the sum's error
 * (< dim * 2^-53 relative) is far below a float32 ulp, so the vector width's summation
 * order (per ISA level) practically never shows in the result. */
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *residual_out, float *out,
                      int64_t rows, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * dim;
        float *ri = residual_out + i * dim, *oi = out + i * dim;
        double sum_sq = 0.0;
        if (residual != NULL) {
            const float *res = residual + i * dim;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < dim; j++) {
                const float r = res[j] + xi[j];
                ri[j] = r;
                sum_sq += (double)r * (double)r;
            }
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < dim; j++) {
                ri[j] = xi[j];
                sum_sq += (double)xi[j] * (double)xi[j];
            }
        }
        /* 1 / sqrt in double, rounded to float32 once: within half an ulp of the true value (torch's
         * float32 mean and vectorised rsqrt are each a rounding further off). No approximate rsqrt. */
        const float inv_rms = (float)(1.0 / sqrt(sum_sq / (double)dim + (double)eps));
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) oi[j] = weight[j] * (ri[j] * inv_rms);
    }
}

static inline f32x16 splat16(float v) { return (f32x16){0} + v; }

static inline f32x16 select16(i32x16 mask, f32x16 if_true, f32x16 if_false) {
    return (f32x16)((mask & (i32x16)if_true) | (~mask & (i32x16)if_false));
}

/* x * sigmoid(x) on 16 lanes, from t = exp(-|x|) (exp_nonpositive's operations, so the exponent is
 * never positive): x * ((x >= 0 ? 1 : t) / (1 + t)). Written with vector types because `omp simd`
 * leaves the scalar form unvectorised below AVX-512 (its selects and clamp stay branches). Below
 * AVX-512 GCC also splits compares of 16 lanes into scalar ones, so the two selects take their masks
 * from sign bits (arithmetic shifts): |x| > 87 from the bits of |x|, x >= 0 from x's sign (-0
 * differs, but takes t = exp(0) = 1 either way). rint is the 1.5 * 2^23 trick (exact for
 * |v| < 2^22, here |v| < 126), which plain SSE2 has. A NaN stays a NaN. */
static inline f32x16 silu16(f32x16 x) {
    const i32x16 bits = (i32x16)x, abs_bits = bits & 0x7FFFFFFF;
    const f32x16 a = select16((0x42AE0000 /* 87.0f */ - abs_bits) >> 31, splat16(87.0f), (f32x16)abs_bits);
    const f32x16 v = -a * EXP_LOG2E; /* exp_nonpositive(-a) from here */
    const f32x16 n = (v + 12582912.0f) - 12582912.0f;
    const f32x16 r = EXP_REDUCE(-a, n);
    const f32x16 p = EXP_POLY(r);
    const f32x16 t = p * (f32x16)((__builtin_convertvector(n, i32x16) + 127) << 23);
    return x * (select16(~(bits >> 31), splat16(1.0f), t) / (1.0f + t));
}

/* out[0, n) = silu(gate) * up for n <= 16 floats (`bytes` = 4n); a partial vector is zero-padded. */
static inline void silu_mul16(const float *gate, const float *up, float *out, size_t bytes) {
    f32x16 g = {0}, u = {0};
    memcpy(&g, gate, bytes);
    memcpy(&u, up, bytes);
    const f32x16 o = silu16(g) * u;
    memcpy(out, &o, bytes);
}

void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *gate = gate_up + i * 2 * dim, *up = gate + dim;
        float *oi = out + i * dim;
        int64_t j = 0;
        for (; j + LANES <= dim; j += LANES) silu_mul16(gate + j, up + j, oi + j, sizeof(f32x16));
        if (j < dim) silu_mul16(gate + j, up + j, oi + j, (size_t)(dim - j) * sizeof(float));
    }
}

#if defined(__AVX512F__)
/* x * sigmoid(x) as silu16 computes it, one element; `omp simd` vectorises it with AVX-512's masks, faster
 * there than the vector-type version (when silu_mul computed it per element, 64 x 1536: 90 vs 109 us). */
static inline float silu(float x) {
    const float t = exp_nonpositive(-fabsf(x));
    return x * ((x >= 0.0f ? 1.0f : t) / (1.0f + t));
}
#endif

/* bf16(silu(x)) for each of the 65536 bfloat16 x, by their bits. A bfloat16 gate has no other values, so
 * silu_mul_bf16 looks its gates up instead of computing an exp and a division per element: the same
 * bits (the table is this level's silu of each), in half the time (SmolLM2's 32 rows x 1536 on Zen 4:
 * 47 -> 24 us). Built once, when the library loads (about 0.1 ms). */
static uint16_t silu_bf16_table[1 << 16];

__attribute__((constructor)) static void build_silu_bf16_table(void) {
#if defined(__AVX512F__)
#pragma omp simd
    for (int32_t g = 0; g < (1 << 16); g++) silu_bf16_table[g] = narrow(silu(widen((uint16_t)g)));
#else /* vector types below AVX-512 for the reason silu16 gives (generic: 4x faster than the scalar loop) */
    for (int32_t g0 = 0; g0 < (1 << 16); g0 += LANES) {
        u16x16 g;
        for (int j = 0; j < LANES; j++) g[j] = (uint16_t)(g0 + j);
        const u16x16 s = __builtin_convertvector(narrow16(silu16((f32x16)widen_bf16x16(g))), u16x16);
        memcpy(silu_bf16_table + g0, &s, sizeof s);
    }
#endif
}

/* out[0, n) = bf16(s * up) for n <= 16 bfloat16 elements (s: silu's, from the table); a partial vector is
 * zero-padded. Vector types below AVX-512: narrow's NaN test stays a branch in an `omp simd` loop there. */
static inline void mul16_bf16(const uint16_t *s, const uint16_t *up, uint16_t *out, size_t n) {
    u16x16 a = {0}, b = {0};
    memcpy(&a, s, n * sizeof s[0]);
    memcpy(&b, up, n * sizeof up[0]);
    const u16x16 o = __builtin_convertvector(narrow16((f32x16)widen_bf16x16(a) * (f32x16)widen_bf16x16(b)), u16x16);
    memcpy(out, &o, n * sizeof out[0]);
}

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *gate = gate_up + i * 2 * dim, *up = gate + dim;
        uint16_t *oi = out + i * dim;
        for (int64_t j0 = 0; j0 < dim; j0 += 256) { /* table lookups (scalar loads: faster than a gather), then * up */
            const int64_t n = dim - j0 < 256 ? dim - j0 : 256;
            uint16_t s[256];
            for (int64_t j = 0; j < n; j++) s[j] = silu_bf16_table[gate[j0 + j]];
#if defined(__AVX512F__)
#pragma omp simd
            for (int64_t j = 0; j < n; j++) oi[j0 + j] = narrow(widen(s[j]) * widen(up[j0 + j]));
#else
            int64_t j = 0;
            for (; j + LANES <= n; j += LANES) mul16_bf16(s + j, up + j0 + j, oi + j0 + j, LANES);
            if (j < n) mul16_bf16(s + j, up + j0 + j, oi + j0 + j, (size_t)(n - j));
#endif
        }
    }
}

/* x: [rows, num_heads, head_dim] with a row stride; cos/sin: [max_position, head_dim] float32.
 * Iteration j reads and writes only elements j and j + half, so rotating in place needs no copy. */
void rope_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_table, const float *sin_table,
              int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *cos_row = cos_table + positions[i] * head_dim, *sin_row = sin_table + positions[i] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *xh = x + i * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                const float lo = xh[j], hi = xh[j + half];
                xh[j] = lo * cos_row[j] + -hi * sin_row[j]; /* rotate_half(x) = [-hi, lo] */
                xh[j + half] = hi * cos_row[j + half] + lo * sin_row[j + half];
            }
        }
    }
}
