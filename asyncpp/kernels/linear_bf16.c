/* bfloat16 linear layer y = x @ w^T for small batches, with AVX512-BF16 dot products.
 *
 * A decode step multiplies a few dozen rows by every weight of the model, so
 * it is bound by streaming the weights from memory, and oneDNN overlaps that
 * stream badly with the arithmetic at these sizes. Here the weight is packed
 * once into panels of 16 output columns by pairs of inputs
 * ([n / 16][k / 2][16][2]: one cache line per pair of inputs), and a block of
 * 64 output columns is computed for up to 6 rows at a time in 24 zmm
 * accumulators (vdpbf16ps: float32 += a0 * b0 + a1 * b1). While a block is
 * computed, the next block's panels are prefetched, spread over the block's
 * row tiles, so memory and arithmetic overlap.
 *
 * Batch invariance: every output y[m, n] is one float32 accumulator summed
 * over the input pairs in order, then rounded to bfloat16 (nearest, ties to
 * even), or written as it is (the `_f32out` entry points: a model's logits).
 * Nothing depends on the number of rows, on the tile a row lands in, or on the
 * thread count, so a token's output never depends on its batch. Many rows may
 * take float32 FMAs instead (bf16_fma.h: the same bits, faster on some CPUs),
 * from `fma_min_rows` rows on, set once per process.
 *
 * Built with -march=native: `linear_bf16_supported()` is 0 where the CPU lacks
 * AVX512-BF16 and the caller falls back to oneDNN.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif

#define PANEL 16                /* output columns per panel: one zmm of float32 */
#define NB 4                    /* panels per block */
#define BLOCK (NB * PANEL)      /* output columns per block */
#define MT 6                    /* rows per tile: NB * MT = 24 accumulators */
#define MCHUNK 96               /* rows that share one pass over the weights */

int linear_bf16_supported(void) { return HAVE_AVX512_BF16; }

/* Where a kernel's outputs go: rows `ld` elements apart, of bfloat16 (f32 = 0) or float32 (f32 = 1). */
typedef struct {
    char *p;
    int64_t ld;
    int f32;
} out_rows;

static inline out_rows out_at(out_rows y, int64_t i) {
    y.p += i * y.ld * (y.f32 ? 4 : 2);
    return y;
}

int64_t linear_bf16_packed_numel(int64_t n, int64_t k) { return (n + BLOCK - 1) / BLOCK * BLOCK * ((k + 1) / 2 * 2); }

void linear_bf16_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t n_pad = (n + BLOCK - 1) / BLOCK * BLOCK, kpairs = (k + 1) / 2;
    for (int64_t p = 0; p < n_pad / PANEL; p++)
        for (int64_t kp = 0; kp < kpairs; kp++)
            for (int64_t j = 0; j < PANEL; j++)
                for (int64_t t = 0; t < 2; t++) {
                    const int64_t row = p * PANEL + j, col = 2 * kp + t;
                    packed[((p * kpairs + kp) * PANEL + j) * 2 + t] = row < n && col < k ? w[row * k + col] : 0;
                }
}

#if HAVE_AVX512_BF16

/* Columns [col, col + 16) of a row, rounded to bfloat16 or as they are (float32); only those below n
 * are written. */
static inline void store_panel(out_rows y, int64_t col, int64_t n, __m512 acc) {
    if (y.f32) {
        const __mmask16 lanes = col + PANEL <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - col)) - 1);
        _mm512_mask_storeu_ps((float *)y.p + col, lanes, acc);
        return;
    }
    uint16_t *row = (uint16_t *)y.p;
    const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc);
    if (col + PANEL <= n) {
        _mm256_storeu_si256((__m256i *)(row + col), out);
    } else {
        uint16_t tail[PANEL];
        _mm256_storeu_si256((__m256i *)tail, out);
        memcpy(row + col, tail, (size_t)(n - col) * sizeof tail[0]);
    }
}

/* Rows [0, mt) of x times one block of panels `wp`; while at it, prefetch the input pairs
 * kp = tile_index (mod num_tiles) of the next block `next` (NULL: none). */
static inline __attribute__((always_inline)) void block_tile(const uint16_t *x, int64_t ldx, const int mt,
                                                             const uint16_t *wp, const uint16_t *next, int64_t k,
                                                             int64_t tile_index, int64_t num_tiles, out_rows y,
                                                             int64_t n0, int64_t n) {
    const int64_t kpairs = (k + 1) / 2, kfull = k / 2, panel_stride = kpairs * 2 * PANEL;
    __m512 acc[MT][NB];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kpairs; kp++) {
        __m512bh w[NB];
        for (int j = 0; j < NB; j++) w[j] = (__m512bh)_mm512_loadu_si512(wp + j * panel_stride + kp * 2 * PANEL);
        if (next != NULL && kp % num_tiles == tile_index)
            for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(next + j * panel_stride + kp * 2 * PANEL), _MM_HINT_T0);
        for (int i = 0; i < mt; i++) {
            uint32_t pair = x[i * ldx + 2 * kp];
            if (kp < kfull) memcpy(&pair, x + i * ldx + 2 * kp, sizeof pair); /* odd k: the last pair is (x, 0) */
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, w[j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NB && n0 + j * PANEL < n; j++) store_panel(out_at(y, i), n0 + j * PANEL, n, acc[i][j]);
}

#define TILE_CASE(rows) \
    case rows: block_tile(x, ldx, rows, wp, next, k, tile_index, num_tiles, y, n0, n); break;

/* One specialised body per row count, so the accumulators stay in registers. */
static void any_tile(const uint16_t *x, int64_t ldx, int mt, const uint16_t *wp, const uint16_t *next, int64_t k,
                     int64_t tile_index, int64_t num_tiles, out_rows y, int64_t n0, int64_t n) {
    switch (mt) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
    }
}

#endif

#include "bf16_blocks.h"
#include "bf16_fma.h"

/* y [m, n] = x [m, k] (row stride ldx) @ w^T, w packed by linear_bf16_pack. */
static void linear_bf16_rows(const uint16_t *x, int64_t ldx, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                             out_rows y, int num_threads) {
#if HAVE_AVX512_BF16
    if (m >= fma_min_rows[0] && fe_linear(-1, x, ldx, m, packed, n, k, NULL, y, num_threads) == 0) return;
    const int64_t num_blocks = (n + BLOCK - 1) / BLOCK, block_numel = BLOCK * ((k + 1) / 2 * 2);
    for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
        const int64_t rows = m - m0 < MCHUNK ? m - m0 : MCHUNK, num_tiles = (rows + MT - 1) / MT;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
        {
            const unsigned csr = csr_enter();
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_blocks; b++) {
                const uint16_t *wp = packed + b * block_numel, *next = b + 1 < num_blocks ? wp + block_numel : NULL;
                for (int64_t t = 0; t < num_tiles; t++) { /* tiles of near-equal size: 16 rows = 6 + 5 + 5 */
                    const int64_t i0 = m0 + t * rows / num_tiles, i1 = m0 + (t + 1) * rows / num_tiles;
                    any_tile(x + i0 * ldx, ldx, (int)(i1 - i0), wp, next, k, t, num_tiles, out_at(y, i0), b * BLOCK, n);
                }
            }
            csr_leave(csr);
        }
    }
#else
    (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)y, (void)num_threads;
#endif
}

/* bfloat16 outputs, row stride ldy. */
void linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, const uint16_t *packed, int64_t n, int64_t k, uint16_t *y,
                 int64_t ldy, int num_threads) {
    linear_bf16_rows(x, ldx, m, packed, n, k, (out_rows){(char *)y, ldy, 0}, num_threads);
}

/* float32 outputs (the sums before rounding), row stride ldy. */
void linear_bf16_f32out(const uint16_t *x, int64_t ldx, int64_t m, const uint16_t *packed, int64_t n, int64_t k,
                        float *y, int64_t ldy, int num_threads) {
    linear_bf16_rows(x, ldx, m, packed, n, k, (out_rows){(char *)y, ldy, 1}, num_threads);
}

/* y [m, n] = x [m, k] bf16 @ w^T, w packed by linear_bf16_q_pack. Returns 0, -1 without AVX512-BF16,
 * -2 when memory for the block sums could not be allocated. */
static int linear_bf16_q_rows(int fmt, const uint16_t *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n,
                              int64_t k, out_rows y, int num_threads) {
#if HAVE_AVX512_BF16
    const int64_t num_blocks = (n + BLOCK - 1) / BLOCK, block_bytes = NB * (k / QK) * qb_panel_block_bytes(fmt);
    if (m <= 0) return 0;
    const __m512i table = qb_q4_table(fmt);
    const int64_t nb = k / QK;
    float *sx = NULL;
    if (fmt == QB_Q4_1) {
        sx = malloc(sizeof(float) * (size_t)(m * nb));
        if (sx == NULL) return -2;
        const unsigned csr = csr_enter();
        qb_block_sums(x, ldx, m, k, sx);
        csr_leave(csr);
    }
    if (m >= fma_min_rows[1] && fe_linear(fmt, x, ldx, m, packed, n, k, sx, y, num_threads) == 0) {
        free(sx);
        return 0;
    }
    const int64_t tile_rows = fmt == QB_Q8_0 ? QB_TILE_ROWS_Q8 : m > QB_TILE_ROWS_Q4 ? QB_TILE_ROWS_Q4_MANY : QB_TILE_ROWS_Q4;
    const int64_t num_tiles = (m + tile_rows - 1) / tile_rows;
    const qb_tile_fn *tiles = fmt == QB_Q8_0 ? qb_tiles_q8_0 : fmt == QB_Q4_0 ? qb_tiles_q4_0 : qb_tiles_q4_1;
    const int64_t num_e_tiles = (m + QE_TILE_ROWS - 1) / QE_TILE_ROWS;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
    {
        const unsigned csr = csr_enter();
        /* More than QE_MIN_ROWS_Q8 (Q4: QE_MIN_ROWS_Q4) rows: expand each BLOCK once (without the buffer:
         * stream, the same bits). */
        const int64_t min_rows = fmt == QB_Q8_0 ? QE_MIN_ROWS_Q8 : QE_MIN_ROWS_Q4;
        struct qb_expanded e = m > min_rows ? qb_expanded_alloc(k) : (struct qb_expanded){NULL, NULL, NULL};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *wb = packed + b * block_bytes;
            if (e.w != NULL) {
                qb_expand_block(fmt, wb, k, table, &e);
                for (int64_t t = 0; t < num_e_tiles; t++) { /* near-equal tiles: 20 rows = 5 + 5 + 5 + 5 */
                    const int64_t i0 = t * m / num_e_tiles, i1 = (t + 1) * m / num_e_tiles;
                    const float *tile_sx = sx == NULL ? NULL : sx + i0 * nb;
                    const char *next = t == 0 ? (const char *)(wb + block_bytes) : NULL; /* may pass the end: a hint */
                    qe_tiles[fmt == QB_Q4_1][i1 - i0 - QE_MIN_TILE_ROWS](x + i0 * ldx, ldx, tile_sx, &e, next,
                                                                         block_bytes / nb, k, out_at(y, i0),
                                                                         b * BLOCK, n);
                }
                continue;
            }
            for (int64_t t = 0; t < num_tiles; t++) { /* tiles of near-equal size: 20 rows = 6 + 7 + 7 */
                const int64_t i0 = t * m / num_tiles, i1 = (t + 1) * m / num_tiles;
                const float *tile_sx = sx == NULL ? NULL : sx + i0 * nb;
                tiles[i1 - i0 - 1](x + i0 * ldx, ldx, tile_sx, t == 0, wb, k, table, out_at(y, i0), b * BLOCK, n);
            }
        }
        free(e.w), free(e.d), free(e.m);
        csr_leave(csr);
    }
    free(sx);
    return 0;
#else
    (void)fmt, (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)y, (void)num_threads;
    return -1;
#endif
}

/* bfloat16 outputs, row stride ldy (the layer stack's linear: qlinear's signature). */
int linear_bf16_q(int fmt, const uint16_t *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n, int64_t k,
                  uint16_t *y, int64_t ldy, int num_threads) {
    return linear_bf16_q_rows(fmt, x, ldx, m, packed, n, k, (out_rows){(char *)y, ldy, 0}, num_threads);
}

/* float32 outputs (the sums before rounding), row stride ldy. */
int linear_bf16_q_f32out(int fmt, const uint16_t *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n,
                         int64_t k, float *y, int64_t ldy, int num_threads) {
    return linear_bf16_q_rows(fmt, x, ldx, m, packed, n, k, (out_rows){(char *)y, ldy, 1}, num_threads);
}
