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
 * even). Nothing depends on the number of rows, on the tile a row lands in, or
 * on the thread count, so a token's output never depends on its batch.
 *
 * Built with -march=native: `linear_bf16_supported()` is 0 where the CPU lacks
 * AVX512-BF16 and the caller falls back to oneDNN.
 */

#include <stdint.h>
#include <string.h>

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

/* Rows [0, mt) of x times one block of panels `wp`; while at it, prefetch the input pairs
 * kp = tile_index (mod num_tiles) of the next block `next` (NULL: none). */
static inline __attribute__((always_inline)) void block_tile(const uint16_t *x, int64_t ldx, const int mt,
                                                             const uint16_t *wp, const uint16_t *next, int64_t k,
                                                             int64_t tile_index, int64_t num_tiles, uint16_t *y,
                                                             int64_t ldy, int64_t n0, int64_t n) {
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
        for (int j = 0; j < NB && n0 + j * PANEL < n; j++) {
            const int64_t col = n0 + j * PANEL;
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(acc[i][j]);
            if (col + PANEL <= n) {
                _mm256_storeu_si256((__m256i *)(y + i * ldy + col), out);
            } else {
                uint16_t tail[PANEL];
                _mm256_storeu_si256((__m256i *)tail, out);
                memcpy(y + i * ldy + col, tail, (size_t)(n - col) * sizeof tail[0]);
            }
        }
}

#define TILE_CASE(rows) \
    case rows: block_tile(x, ldx, rows, wp, next, k, tile_index, num_tiles, y, ldy, n0, n); break;

/* One specialised body per row count, so the accumulators stay in registers. */
static void any_tile(const uint16_t *x, int64_t ldx, int mt, const uint16_t *wp, const uint16_t *next, int64_t k,
                     int64_t tile_index, int64_t num_tiles, uint16_t *y, int64_t ldy, int64_t n0, int64_t n) {
    switch (mt) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
    }
}

#endif

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ w^T, w packed by linear_bf16_pack. */
void linear_bf16(const uint16_t *x, int64_t ldx, int64_t m, const uint16_t *packed, int64_t n, int64_t k, uint16_t *y,
                 int64_t ldy, int num_threads) {
#if HAVE_AVX512_BF16
    const int64_t num_blocks = (n + BLOCK - 1) / BLOCK, block_numel = BLOCK * ((k + 1) / 2 * 2);
    for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
        const int64_t rows = m - m0 < MCHUNK ? m - m0 : MCHUNK, num_tiles = (rows + MT - 1) / MT;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint16_t *wp = packed + b * block_numel, *next = b + 1 < num_blocks ? wp + block_numel : NULL;
            for (int64_t t = 0; t < num_tiles; t++) { /* tiles of near-equal size: 16 rows = 6 + 5 + 5 */
                const int64_t i0 = m0 + t * rows / num_tiles, i1 = m0 + (t + 1) * rows / num_tiles;
                any_tile(x + i0 * ldx, ldx, (int)(i1 - i0), wp, next, k, t, num_tiles, y + i0 * ldy, ldy, b * BLOCK, n);
            }
        }
    }
#else
    (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)y, (void)ldy, (void)num_threads;
#endif
}
