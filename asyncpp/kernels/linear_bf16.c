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

/* Columns [col, col + 16) of a row, rounded to bfloat16; only those below n are written. */
static inline void store_panel_bf16(uint16_t *row, int64_t col, int64_t n, __m512 acc) {
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
        for (int j = 0; j < NB && n0 + j * PANEL < n; j++) store_panel_bf16(y + i * ldy, n0 + j * PANEL, n, acc[i][j]);
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

/* ---- GGUF blocks (Q8_0, Q4_0, Q4_1) expanded to bfloat16 in the kernel ----
 *
 * The same products as above on the weight `round_bf16(dequantize(blocks))`, the weight the
 * float path would pack (GGUF's float32 dequantization d * q (+ m), rounded to nearest even),
 * so the two give the same bits; the blocks stay in memory, 3.2x (Q4_1) smaller than bf16.
 * Layout: per BLOCK of 64 columns, per 32-input block b, per panel: [d: 16 x fp16][m: 16 x
 * fp16, Q4_1][values], one row per pair of inputs (2p, 2p + 1), ordered so that dpbf16's
 * operand comes out of one conversion with no shuffle: in the float32 vectors A (columns 0-7)
 * and B (columns 8-15), lane 2c + t is column c (or c + 8), input 2p + t. Q4: 16 rows of 16
 * bytes, byte 2c + t holding A's value in its low nibble and B's in its high one; Q8_0: 16 rows
 * of 32 int8, A's 16 then B's 16. One or a few rows expand each pair in registers; more rows
 * expand a block of columns once into the layout above (an L2 scratch) and run the same tiles
 * on it. */

enum { QB_Q8_0 = 3, QB_Q4_0 = 4, QB_Q4_1 = 5 }; /* qlinear's format codes */
#define QK 32
#define QB_GEMV_ROWS 4 /* up to this many rows expand the weights in registers */

static int64_t qb_panel_block_bytes(int fmt) {
    switch (fmt) {
        case QB_Q8_0: return PANEL * 2 + QK * PANEL;
        case QB_Q4_0: return PANEL * 2 + QK / 2 * PANEL;
        case QB_Q4_1: return PANEL * 4 + QK / 2 * PANEL;
    }
    return 0;
}

int linear_bf16_q_check(int fmt, int64_t k) { return qb_panel_block_bytes(fmt) > 0 && k > 0 && k % QK == 0 ? 0 : 1; }

int64_t linear_bf16_q_packed_nbytes(int fmt, int64_t n, int64_t k) {
    return (n + BLOCK - 1) / BLOCK * NB * (k / QK) * qb_panel_block_bytes(fmt);
}

/* Byte offset, within a panel block's values, of (column `lane`, input j); for Q4 also which nibble. */
static int64_t qb_value_offset(int fmt, int lane, int j, int *high_nibble) {
    const int p = j / 2, t = j % 2, c = lane % 8, half = lane / 8; /* half 0: vector A, 1: vector B */
    *high_nibble = half;
    if (fmt == QB_Q8_0) return p * 32 + half * 16 + 2 * c + t;
    return p * 16 + 2 * c + t;
}

static int64_t qb_header_bytes(int fmt) { return fmt == QB_Q4_1 ? PANEL * 4 : PANEL * 2; }

/* One GGUF block of row r (at `s`) -> its lane of a panel block (`blk`). */
static void qb_pack_block(int fmt, const uint8_t *s, uint8_t *blk, int lane) {
    memcpy(blk + lane * 2, s, 2); /* d */
    uint8_t *values = blk + qb_header_bytes(fmt);
    int high;
    if (fmt == QB_Q8_0) {
        for (int j = 0; j < QK; j++) values[qb_value_offset(fmt, lane, j, &high)] = s[2 + j];
        return;
    }
    const int hdr = fmt == QB_Q4_1 ? 4 : 2;
    if (fmt == QB_Q4_1) memcpy(blk + PANEL * 2 + lane * 2, s + 2, 2); /* m */
    for (int j = 0; j < QK; j++) {
        const uint8_t byte = s[hdr + j % (QK / 2)], q = j < QK / 2 ? byte & 15 : byte >> 4; /* GGUF: j, j + 16 */
        uint8_t *v = values + qb_value_offset(fmt, lane, j, &high);
        *v = high ? (uint8_t)((*v & 15) | q << 4) : (uint8_t)((*v & 0xF0) | q);
    }
}

/* GGUF rows `src` ([n] rows of k / 32 blocks) -> `dst` (linear_bf16_q_packed_nbytes, zeroed here). */
void linear_bf16_q_pack(int fmt, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt), src_block = fmt == QB_Q8_0 ? 34 : fmt == QB_Q4_1 ? 20 : 18;
    memset(dst, 0, (size_t)linear_bf16_q_packed_nbytes(fmt, n, k));
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t block = r / BLOCK, panel = r % BLOCK / PANEL, lane = r % PANEL;
            qb_pack_block(fmt, src + (r * nb + b) * src_block, dst + ((block * nb + b) * NB + panel) * pb, (int)lane);
        }
}

/* The dequantized float32 weight of input j (0..31) of lane `lane` of a panel block (scalar). */
static float qb_weight(int fmt, const uint8_t *blk, int lane, int j) {
    uint16_t h;
    memcpy(&h, blk + lane * 2, 2);
    const float d = half_to_float(h);
    int high;
    const uint8_t byte = blk[qb_header_bytes(fmt) + qb_value_offset(fmt, lane, j, &high)];
    if (fmt == QB_Q8_0) return d * (float)(int8_t)byte;
    const float q = (float)(high ? byte >> 4 : byte & 15);
    if (fmt == QB_Q4_0) return d * (q - 8.0f);
    memcpy(&h, blk + PANEL * 2 + lane * 2, 2);
    return d * q + half_to_float(h);
}

/* out [num_ids, k] float32 = rows `ids` of a weight packed by linear_bf16_q_pack, dequantized (float32). */
void linear_bf16_q_dequant_rows(int fmt, const uint8_t *packed, int64_t k, const int64_t *ids, int64_t num_ids,
                                float *out) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt);
    for (int64_t i = 0; i < num_ids; i++) {
        const int64_t r = ids[i], block = r / BLOCK, panel = r % BLOCK / PANEL, lane = r % PANEL;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = packed + ((block * nb + b) * NB + panel) * pb;
            for (int j = 0; j < QK; j++) out[i * k + b * QK + j] = qb_weight(fmt, blk, (int)lane, j);
        }
    }
}

#if HAVE_AVX512_BF16

/* Pair p (inputs 2p, 2p + 1) of a panel block as 16 lanes of bfloat16 pairs, rounded as torch rounds.
 * `d` and `m` are the block's scales spread to vector A's lanes (columns 0-7, each twice) and B's. */
static inline __attribute__((always_inline)) __m512bh qb_pair(const int fmt, const uint8_t *blk, int p, __m512 da,
                                                              __m512 db, __m512 ma, __m512 mb) {
    const uint8_t *values = blk + (fmt == QB_Q4_1 ? PANEL * 4 : PANEL * 2);
    __m512 a, b;
    if (fmt == QB_Q8_0) {
        const int8_t *q = (const int8_t *)values + p * 32;
        a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), da);
        b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), db);
    } else {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(values + p * 16)));
        /* d * q is exact in float32, so one fma rounds like GGUF's d * q + m; Q4_0's m is -8 d (exact). */
        a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), da, ma);
        b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), db, mb);
    }
    /* bf16 elements 0-15 from A, 16-31 from B: dword lane i is (column i, inputs 2p and 2p + 1) */
    return _mm512_cvtne2ps_pbh(b, a);
}

/* The block's scales d and m (Q4_0: -8 d), spread to vector A's and B's lanes. */
static inline __attribute__((always_inline)) void qb_scales(const int fmt, const uint8_t *blk, __m512 *da, __m512 *db,
                                                            __m512 *ma, __m512 *mb) {
    const __m512i to_a = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i to_b = _mm512_add_epi32(to_a, _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 m = fmt == QB_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + PANEL * 2)))
                                    : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    *da = _mm512_permutexvar_ps(to_a, d);
    *db = _mm512_permutexvar_ps(to_b, d);
    *ma = _mm512_permutexvar_ps(to_a, m);
    *mb = _mm512_permutexvar_ps(to_b, m);
}

/* Rows [0, mt) times one BLOCK of columns, expanding each pair in registers (few rows). */
static inline __attribute__((always_inline)) void qb_gemv_tile(const int fmt, const int mt, const uint16_t *x,
                                                               int64_t ldx, const uint8_t *wb, int64_t k, uint16_t *y,
                                                               int64_t ldy, int64_t n0, int64_t n) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt);
    __m512 acc[QB_GEMV_ROWS][NB];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blocks = wb + b * NB * pb;
        __m512 da[NB], db[NB], ma[NB], mb[NB];
        for (int j = 0; j < NB; j++) qb_scales(fmt, blocks + j * pb, &da[j], &db[j], &ma[j], &mb[j]);
        if (b + 2 < nb)
            for (int64_t off = 0; off < NB * pb; off += 64) _mm_prefetch((const char *)(blocks + 2 * NB * pb + off), _MM_HINT_T0);
        for (int p = 0; p < QK / 2; p++) {
            const int64_t kp = b * QK / 2 + p;
            for (int j = 0; j < NB; j++) {
                const __m512bh w = qb_pair(fmt, blocks + j * pb, p, da[j], db[j], ma[j], mb[j]);
                for (int i = 0; i < mt; i++) {
                    uint32_t pair;
                    memcpy(&pair, x + i * ldx + 2 * kp, sizeof pair);
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)_mm512_set1_epi32((int)pair), w);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NB && n0 + j * PANEL < n; j++) store_panel_bf16(y + i * ldy, n0 + j * PANEL, n, acc[i][j]);
}

#define QB_GEMV_CASE(F, R) \
    case R: qb_gemv_tile(F, R, x, ldx, wb, k, y, ldy, n0, n); break;
#define QB_GEMV_FN(F)                                                                                               \
    static void qb_gemv_##F(int mt, const uint16_t *x, int64_t ldx, const uint8_t *wb, int64_t k, uint16_t *y,     \
                            int64_t ldy, int64_t n0, int64_t n) {                                                  \
        switch (mt) { QB_GEMV_CASE(F, 1) QB_GEMV_CASE(F, 2) QB_GEMV_CASE(F, 3) QB_GEMV_CASE(F, 4) }                 \
    }
QB_GEMV_FN(QB_Q8_0)
QB_GEMV_FN(QB_Q4_0)
QB_GEMV_FN(QB_Q4_1)

/* One BLOCK of columns expanded into linear_bf16_pack's layout ([NB panels][k / 2 pairs][16][2]). */
static inline __attribute__((always_inline)) void qb_expand(const int fmt, const uint8_t *wb, int64_t k,
                                                            uint16_t *dst) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt), panel_stride = k * PANEL;
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < NB; j++) {
            const uint8_t *blk = wb + (b * NB + j) * pb;
            __m512 da, db, ma, mb;
            qb_scales(fmt, blk, &da, &db, &ma, &mb);
            for (int p = 0; p < QK / 2; p++)
                _mm512_storeu_si512(dst + j * panel_stride + (b * QK / 2 + p) * 2 * PANEL,
                                    (__m512i)qb_pair(fmt, blk, p, da, db, ma, mb));
        }
}

static void qb_expand_any(int fmt, const uint8_t *wb, int64_t k, uint16_t *dst) {
    if (fmt == QB_Q8_0) qb_expand(QB_Q8_0, wb, k, dst);
    else if (fmt == QB_Q4_0) qb_expand(QB_Q4_0, wb, k, dst);
    else qb_expand(QB_Q4_1, wb, k, dst);
}

#endif

/* y [m, n] bf16 = x [m, k] bf16 @ w^T, w packed by linear_bf16_q_pack. Returns 0, -1 without AVX512-BF16,
 * -2 when scratch memory could not be allocated. */
int linear_bf16_q(int fmt, const uint16_t *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n, int64_t k,
                  uint16_t *y, int64_t ldy, int num_threads) {
#if HAVE_AVX512_BF16
    const int64_t num_blocks = (n + BLOCK - 1) / BLOCK, block_bytes = NB * (k / QK) * qb_panel_block_bytes(fmt);
    if (m <= 0) return 0;
    if (m <= QB_GEMV_ROWS) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
        for (int64_t b = 0; b < num_blocks; b++) {
            const uint8_t *wb = packed + b * block_bytes;
            if (fmt == QB_Q8_0) qb_gemv_QB_Q8_0((int)m, x, ldx, wb, k, y, ldy, b * BLOCK, n);
            else if (fmt == QB_Q4_0) qb_gemv_QB_Q4_0((int)m, x, ldx, wb, k, y, ldy, b * BLOCK, n);
            else qb_gemv_QB_Q4_1((int)m, x, ldx, wb, k, y, ldy, b * BLOCK, n);
        }
        return 0;
    }
    int status = 0;
#pragma omp parallel num_threads(num_threads > 1 && num_blocks > 1 ? num_threads : 1)
    {
        uint16_t *scratch = aligned_alloc(64, (size_t)(BLOCK * k) * sizeof(uint16_t)); /* one BLOCK, expanded */
        if (scratch == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_blocks; b++) {
            if (scratch == NULL) continue;
            qb_expand_any(fmt, packed + b * block_bytes, k, scratch);
            for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
                const int64_t rows = m - m0 < MCHUNK ? m - m0 : MCHUNK, num_tiles = (rows + MT - 1) / MT;
                for (int64_t t = 0; t < num_tiles; t++) {
                    const int64_t i0 = m0 + t * rows / num_tiles, i1 = m0 + (t + 1) * rows / num_tiles;
                    any_tile(x + i0 * ldx, ldx, (int)(i1 - i0), scratch, NULL, k, t, num_tiles, y + i0 * ldy, ldy,
                             b * BLOCK, n);
                }
            }
        }
        free(scratch);
    }
    return status;
#else
    (void)fmt, (void)x, (void)ldx, (void)m, (void)packed, (void)n, (void)k, (void)y, (void)ldy, (void)num_threads;
    return -1;
#endif
}
