/* Fused bfloat16 elementwise ops for the Llama layer on CPU, one pass each.
 *
 * Each op reproduces the roundings of the unfused bfloat16 torch code it
 * replaces (every intermediate torch would store is rounded to bfloat16 here
 * too), so only the order of a float32 sum can differ. Rows are independent
 * and computed in a fixed order: results never depend on the batch.
 *
 *   add_rms_norm: residual_out = residual + x (or x); out = w * bf16(r * rsqrt(mean(r^2) + eps))
 *   silu_mul:     out = bf16(silu(gate)) * up, gate_up = [gate | up] per row
 *   rope:         x = bf16(x * cos) + bf16(rotate_half(x) * sin) in place, per head
 */

#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

/* Below this many rows a step is one thread's work: waking a team costs more. */
#define MIN_ROWS_PER_THREAD 16

/* x * sigmoid(x), from exp(-|x|) so the exponent is never positive. */
static inline float silu(float x) {
    const float t = exp_nonpositive(-fabsf(x));
    return x * ((x >= 0.0f ? 1.0f : t) / (1.0f + t));
}

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

void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t dim, int num_threads) {
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *gate = gate_up + i * 2 * dim, *up = gate + dim;
        uint16_t *oi = out + i * dim;
#pragma omp simd
        for (int64_t j = 0; j < dim; j++) {
            const float g = widen(gate[j]);
            oi[j] = narrow(round_bf16(silu(g)) * widen(up[j]));
        }
    }
}

/* x: [rows, num_heads, head_dim] with a row stride; cos/sin: [max_position, head_dim] float32. */
void rope_bf16(uint16_t *x, int64_t row_stride, const int64_t *positions, const float *cos_table,
               const float *sin_table, int64_t rows, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *cos_row = cos_table + positions[i] * head_dim, *sin_row = sin_table + positions[i] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            uint16_t *xh = x + i * row_stride + h * head_dim;
            float lo[256], hi[256];
            for (int64_t j = 0; j < half; j++) {
                lo[j] = widen(xh[j]);
                hi[j] = widen(xh[j + half]);
            }
#pragma omp simd
            for (int64_t j = 0; j < half; j++) {
                /* rotate_half(x) = [-hi, lo]; cos/sin are cast to bfloat16 first, like the torch code. */
                const float c0 = round_bf16(cos_row[j]), s0 = round_bf16(sin_row[j]);
                const float c1 = round_bf16(cos_row[j + half]), s1 = round_bf16(sin_row[j + half]);
                xh[j] = narrow(round_bf16(lo[j] * c0) + round_bf16(-hi[j] * s0));
                xh[j + half] = narrow(round_bf16(hi[j] * c1) + round_bf16(lo[j] * s1));
            }
        }
    }
}
