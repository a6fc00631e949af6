/* Many rows with float32 FMA, to the bit what vdpbf16ps gives: for linear_bf16.c, which includes this file once
 * after bf16_blocks.h (it uses their PANEL, NB, BLOCK, QK, out_rows, store_panel, qb_pairs, qb_scales and
 * qb_block_step).
 *
 * Some cores multiply float32 faster than pairs of bfloat16: on a Xeon (family 6 model 207) vfmadd runs
 * 80 GMAC/s a core and vdpbf16ps 41 (`python -m asyncpp.bench.peak`); on a Zen 4 it is the other way round.
 * This path takes the same packed weights as the vdpbf16ps paths and gives the same bits:
 *
 * - vdpbf16ps sums acc + a_odd * b_odd, then + a_even * b_even: each product of two bfloat16 values is exact
 *   in float32, each sum is rounded to nearest even, and denormal inputs and results are flushed to zero.
 *   Two FMAs in that order under MXCSR DAZ | FTZ do exactly that (3.2e7 random lanes, denormals included,
 *   on the Xeon above; `linear_choice.fma_matches_dpbf16` checks it on the CPU at hand before this path is
 *   chosen);
 * - every bfloat16 linear runs under DAZ | FTZ (`csr_enter`), so the block steps that follow the dot
 *   products (acc += d * part, + m * sx) agree as well.
 *
 * So rows may take either path by their number (`fma_min_rows`, set once per process from a measurement)
 * and a row's result still never depends on its batch.
 *
 * A thread expands each BLOCK it owns once into float32 operands: `w` [NB panels][k_pad][PANEL], input
 * 2kp + 1 before 2kp (vdpbf16ps's order), split from the dpbf16 operands the other paths multiply (float
 * weights: the packed pairs; GGUF blocks: qb_pairs, with d and m widened as in qb_expanded). The rows'
 * inputs are widened to float32 once per call, in the same order. A tile of up to 6 rows keeps its sums in
 * registers: float weights, 6 rows x 4 panels (24 sums; per input, 4 loads of weights (L2), 6 broadcasts
 * (L1) and 24 FMAs); GGUF blocks, 2 panels at a time as qe_tile (12 partial sums per block and 12 sums;
 * 0.87x at 4 panels with the sums in an L1 array, SmolLM2's linears at 256 rows, Zen 4).
 */

#ifndef ASYNCPP_BF16_FMA_H
#define ASYNCPP_BF16_FMA_H

#define FE_TILE_ROWS 6
/* Rows that share one expansion of a BLOCK: their float32 inputs (96 x 1536 x 4 B = 576 KB) and the
 * expanded BLOCK (4 x 1536 x 64 B = 384 KB) stay in L2 together. */
#define FE_MCHUNK 96
#define MXCSR_DAZ_FTZ 0x8040u

/* Rows from which each weight kind takes the FMA path (INT64_MAX: never): [float weights, GGUF blocks]. */
static int64_t fma_min_rows[2] = {INT64_MAX, INT64_MAX};

void linear_bf16_set_fma_min_rows(int64_t float_rows, int64_t block_rows) {
    fma_min_rows[0] = float_rows > 0 ? float_rows : INT64_MAX;
    fma_min_rows[1] = block_rows > 0 ? block_rows : INT64_MAX;
}

int64_t linear_bf16_fma_min_rows(int blocks) { return fma_min_rows[blocks != 0]; }

#if HAVE_AVX512_BF16

/* The calling thread's MXCSR with denormals flushed (inputs and results); returns the old one for csr_leave. */
static inline unsigned csr_enter(void) {
    const unsigned old = _mm_getcsr();
    _mm_setcsr(old | MXCSR_DAZ_FTZ);
    return old;
}

static inline void csr_leave(unsigned old) { _mm_setcsr(old); }

/* A thread's float32 operands of one BLOCK; w == NULL if they could not be allocated. */
struct fe_expanded {
    float *w;     /* [NB][k_pad][PANEL] */
    float *d, *m; /* GGUF blocks: [k / 32][NB][PANEL], the scales and Q4_1 offsets */
};

static struct fe_expanded fe_alloc(int64_t k_pad, int blocks) {
    const size_t w_bytes = (size_t)(NB * k_pad * PANEL) * sizeof(float);
    const size_t s_bytes = blocks ? (size_t)(k_pad / QK * NB * PANEL) * sizeof(float) : 64;
    struct fe_expanded e = {aligned_alloc(64, w_bytes), aligned_alloc(64, s_bytes), aligned_alloc(64, s_bytes)};
    if (e.w == NULL || e.d == NULL || e.m == NULL) {
        free(e.w), free(e.d), free(e.m);
        e = (struct fe_expanded){NULL, NULL, NULL};
    }
    return e;
}

static void fe_free(struct fe_expanded e) { free(e.w), free(e.d), free(e.m); }

/* A dpbf16 operand (dword lane c: column c's inputs 2kp, low half, and 2kp + 1, high half) -> `w`: the
 * 16 columns' input 2kp + 1, then (at w + PANEL) their input 2kp, as float32. */
static inline void fe_store_pair(float *w, __m512bh v) {
    const __m512i u = (__m512i)v;
    _mm512_store_ps(w, _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u))));
    _mm512_store_ps(w + PANEL, _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
}

/* Float weights: one BLOCK of linear_bf16_pack's panels (`wp`, kpairs pairs) -> e. */
static void fe_expand_float(const uint16_t *wp, int64_t kpairs, const struct fe_expanded *e) {
    for (int j = 0; j < NB; j++)
        for (int64_t kp = 0; kp < kpairs; kp++)
            fe_store_pair(e->w + (j * 2 * kpairs + 2 * kp) * PANEL,
                          (__m512bh)_mm512_loadu_si512(wp + (j * kpairs + kp) * 2 * PANEL));
}

/* GGUF blocks: one BLOCK of linear_bf16_q_pack's panel blocks (`wb`) -> e. */
static void fe_expand_blocks(const int fmt, const uint8_t *wb, int64_t k, __m512i q4_table,
                             const struct fe_expanded *e) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt), hdr = qb_header_bytes(fmt);
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < NB; j++) {
            const uint8_t *blk = wb + (b * NB + j) * pb;
            for (int p = 0; p < QPAIRS; p += 2) {
                __m512bh w0, w1;
                qb_pairs(fmt, blk + hdr, p, q4_table, &w0, &w1);
                fe_store_pair(e->w + (j * k + 2 * (b * QPAIRS + p)) * PANEL, w0);
                fe_store_pair(e->w + (j * k + 2 * (b * QPAIRS + p + 1)) * PANEL, w1);
            }
            __m512 d, m;
            qb_scales(fmt, blk, &d, &m);
            _mm512_store_ps(e->d + (b * NB + j) * PANEL, d);
            _mm512_store_ps(e->m + (b * NB + j) * PANEL, m);
        }
}

/* xf [m][k_pad]: the rows of x as float32, each pair's input 2kp + 1 first (odd k: the last pair's is 0). */
static void fe_widen_rows(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, float *xf) {
    const int64_t kpairs = (k + 1) / 2;
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = x + i * ldx;
        float *out = xf + i * 2 * kpairs;
        for (int64_t kp = 0; kp < kpairs; kp++) {
            out[2 * kp] = 2 * kp + 1 < k ? widen(row[2 * kp + 1]) : 0.0f;
            out[2 * kp + 1] = widen(row[2 * kp]);
        }
    }
}

/* part[i][j] += xf[i][t] * w[j0 + j][t] for inputs t in [t0, t1) and panels j in [0, np): the vdpbf16ps
 * sums, one FMA at a time. */
#define FE_STEPS(t0, t1, j0, np)                                                                       \
    for (int64_t t = (t0); t < (t1); t++) {                                                           \
        __m512 w[NB];                                                                                 \
        for (int j = 0; j < (np); j++) w[j] = _mm512_load_ps(e->w + (((j0) + j) * k_pad + t) * PANEL); \
        for (int i = 0; i < mt; i++) {                                                                \
            const __m512 a = _mm512_set1_ps(xf[i * k_pad + t]);                                       \
            for (int j = 0; j < (np); j++) part[i][j] = _mm512_fmadd_ps(a, w[j], part[i][j]);         \
        }                                                                                             \
    }

/* Bring `bytes` at `p` into L2 (a hint: p may pass the end of the weights). */
static inline void fe_prefetch(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

/* Rows [0, mt) of xf times the expanded BLOCK e, 32 inputs at a time. kind 0: float weights, one sum
 * over all of k_pad, 4 panels at once; 1, 2: GGUF blocks, 2 panels at a time, per 32 inputs `part`, then
 * acc += d * part (2: + m * sx), both in registers. `next` (NULL: none): the packed weights of the
 * thread's next BLOCK, `ahead` bytes of them per 32 inputs requested into L2 meanwhile, so that its
 * expansion does not wait on memory. */
static inline __attribute__((always_inline)) void fe_tile(const int kind, const int mt, const float *xf,
                                                          int64_t k_pad, const float *sx,
                                                          const struct fe_expanded *e, const char *next,
                                                          int64_t ahead, out_rows y, int64_t n0, int64_t n) {
    __m512 part[FE_TILE_ROWS][NB];
    const int64_t groups = (k_pad + QK - 1) / QK;
    if (kind == 0) {
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < NB; j++) part[i][j] = _mm512_setzero_ps();
        for (int64_t g = 0; g < groups; g++) {
            if (next != NULL) fe_prefetch(next + g * ahead, ahead);
            FE_STEPS(g * QK, g * QK + QK < k_pad ? g * QK + QK : k_pad, 0, NB)
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < NB && n0 + j * PANEL < n; j++) store_panel(out_at(y, i), n0 + j * PANEL, n, part[i][j]);
        return;
    }
    for (int j0 = 0; j0 < NB; j0 += QE_PANELS) { /* as qe_tile: 12 partial sums and 12 sums in registers */
        __m512 acc[FE_TILE_ROWS][QE_PANELS];
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < QE_PANELS; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < groups; b++) {
            if (next != NULL && j0 == 0) fe_prefetch(next + b * ahead, ahead);
            for (int i = 0; i < mt; i++)
                for (int j = 0; j < QE_PANELS; j++) part[i][j] = _mm512_setzero_ps();
            FE_STEPS(b * QK, (b + 1) * QK, j0, QE_PANELS)
            for (int j = 0; j < QE_PANELS; j++) {
                const __m512 d = _mm512_load_ps(e->d + (b * NB + j0 + j) * PANEL);
                const __m512 m = kind == 2 ? _mm512_load_ps(e->m + (b * NB + j0 + j) * PANEL) : _mm512_setzero_ps();
                for (int i = 0; i < mt; i++)
                    acc[i][j] = qb_block_step(kind == 2, acc[i][j], part[i][j], d, m, kind == 2 ? sx[i * groups + b] : 0.0f);
            }
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < QE_PANELS && n0 + (j0 + j) * PANEL < n; j++)
                store_panel(out_at(y, i), n0 + (j0 + j) * PANEL, n, acc[i][j]);
    }
}

typedef void (*fe_tile_fn)(const float *, int64_t, const float *, const struct fe_expanded *, const char *, int64_t,
                           out_rows, int64_t, int64_t);
#define FE_TILE_DEF(KIND, R)                                                                                   \
    static __attribute__((noinline, aligned(64))) void fe_tile_##KIND##_##R(                                    \
        const float *xf, int64_t k_pad, const float *sx, const struct fe_expanded *e, const char *next,         \
        int64_t ahead, out_rows y, int64_t n0, int64_t n) {                                                    \
        fe_tile(KIND, R, xf, k_pad, sx, e, next, ahead, y, n0, n);                                             \
    }
#define FE_SHAPES(KIND) \
    FE_TILE_DEF(KIND, 1) FE_TILE_DEF(KIND, 2) FE_TILE_DEF(KIND, 3) FE_TILE_DEF(KIND, 4) FE_TILE_DEF(KIND, 5) FE_TILE_DEF(KIND, 6)
FE_SHAPES(0)
FE_SHAPES(1)
FE_SHAPES(2)
#define FE_TILES(KIND) \
    {fe_tile_##KIND##_1, fe_tile_##KIND##_2, fe_tile_##KIND##_3, fe_tile_##KIND##_4, fe_tile_##KIND##_5, fe_tile_##KIND##_6}
/* By [kind][rows - 1]. */
static const fe_tile_fn fe_tiles[3][FE_TILE_ROWS] = {FE_TILES(0), FE_TILES(1), FE_TILES(2)};

/* y [m, n] = x [m, k] @ w^T on the FMA path. fmt < 0: float weights packed by linear_bf16_pack; else a GGUF
 * format packed by linear_bf16_q_pack, `sx` its rows' block sums (Q4_1) or NULL. Returns 0, or -2 when
 * memory could not be allocated. */
static int fe_linear(int fmt, const uint16_t *x, int64_t ldx, int64_t m, const void *packed, int64_t n, int64_t k,
                     const float *sx, out_rows y, int num_threads) {
    const int blocks = fmt >= 0, kind = !blocks ? 0 : fmt == QB_Q4_1 ? 2 : 1;
    const int64_t kpairs = (k + 1) / 2, k_pad = 2 * kpairs, num_blocks = (n + BLOCK - 1) / BLOCK;
    const int64_t block_bytes = blocks ? NB * (k / QK) * qb_panel_block_bytes(fmt) : (int64_t)BLOCK * k_pad * 2;
    const int64_t nb = k_pad / QK;
    const int64_t ahead = (block_bytes / ((k_pad + QK - 1) / QK) + 63) / 64 * 64; /* bytes per 32 inputs */
    float *xf = malloc(sizeof(float) * (size_t)(m * k_pad));
    if (xf == NULL) return -2;
    fe_widen_rows(x, ldx, m, k, xf);
    const __m512i table = blocks ? qb_q4_table(fmt) : _mm512_setzero_si512();
    int status = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_blocks > 1)
    {
        const unsigned csr = csr_enter();
        const struct fe_expanded e = fe_alloc(k_pad, blocks);
        if (e.w == NULL) {
#pragma omp atomic write
            status = -2;
        }
        for (int64_t m0 = 0; m0 < m; m0 += FE_MCHUNK) {
            const int64_t rows = m - m0 < FE_MCHUNK ? m - m0 : FE_MCHUNK, num_tiles = (rows + FE_TILE_ROWS - 1) / FE_TILE_ROWS;
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_blocks; b++) {
                if (e.w == NULL) continue;
                const char *wb = (const char *)packed + b * block_bytes;
                if (blocks) fe_expand_blocks(fmt, (const uint8_t *)wb, k, table, &e);
                else fe_expand_float((const uint16_t *)wb, kpairs, &e);
                for (int64_t t = 0; t < num_tiles; t++) { /* near-equal tiles: 20 rows = 5 + 5 + 5 + 5 */
                    const int64_t i0 = m0 + t * rows / num_tiles, i1 = m0 + (t + 1) * rows / num_tiles;
                    const char *next = t == 0 ? wb + block_bytes : NULL; /* the first tile prefetches the next BLOCK */
                    fe_tiles[kind][i1 - i0 - 1](xf + i0 * k_pad, k_pad, sx == NULL ? NULL : sx + i0 * nb, &e, next,
                                                ahead, out_at(y, i0), b * BLOCK, n);
                }
            }
        }
        fe_free(e);
        csr_leave(csr);
    }
    free(xf);
    return status;
}

#endif
#endif /* ASYNCPP_BF16_FMA_H */
