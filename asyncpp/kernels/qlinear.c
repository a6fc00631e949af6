/* Linear layer y = x @ w^T with float32 activations and weights kept in their stored format:
 * float32, float16, bfloat16, or GGUF's Q8_0, Q4_0 and Q4_1 blocks, dequantized in registers.
 *
 * Layout. The weight [n, k] is packed once into panels of 16 output columns
 * (LANES); within a panel the 16 columns sit side by side, so one vector load
 * gives one input position for 8 (AVX2) or 16 (AVX-512) columns and every
 * output column is one vector lane. A quantized panel is a run of blocks of 32
 * inputs, each block [scale d: 16 x fp16][min m: 16 x fp16, Q4_1 only][values]:
 * Q8_0 values are 32 rows of 16 int8, Q4_0/Q4_1 values are 16 rows of 16 bytes
 * whose low nibble is input j and high nibble input j + 16 (GGUF's own pairing).
 * The scales and 4/8-bit values are the file's, unchanged; only their order is.
 * `n` is padded to a multiple of 64 columns (4 panels) with zero columns.
 *
 * Arithmetic, fixed for every output whatever the batch, tile, thread or ISA:
 *   float formats: acc = sum over k in order of fma(x[k], w[k], acc);
 *   block formats: per block b, t = sum over j in order of fma(x[j], q[j], t)
 *     (Q4: j = 0, 16, 1, 17, ..., 15, 31; Q8_0: j = 0..31), then
 *     acc = fma(t, d, acc) and, for Q4, acc = fma(m, X_b, acc), where X_b is the
 *     block's sum of x (in order, computed once per row) and m is Q4_1's min or
 *     -8 d for Q4_0 (exact). This is the dot product with the dequantized weights
 *     d * q + m, factored so that the 4-bit values need no per-weight scaling.
 * Every lane runs the same operation sequence, so AVX2 and AVX-512 give the same
 * bits (and a row's result never depends on its batch). The generic build has no
 * FMA on x86-64 and rounds a * b + c twice; it is tested against a float64
 * reference like the others.
 *
 * Threads split the panels; each output is computed by one thread.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define MT_MAX 12
#define NG_WIDE 2 /* groups per tile when it has several rows (a whole number of panels) */
#define NG_GEMV_ROWS 6 /* up to this many rows a tile takes NG_GEMV groups (see the tile) */
#define ACC_IN_MEMORY 1 /* block formats: the accumulators live in L1, not registers (see the tile) */
#define NUM_VREGS 32
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define VW 8
#define MT_MAX 5
#define NG_WIDE 2
#define NG_GEMV_ROWS 1
#define ACC_IN_MEMORY 1
#define NUM_VREGS 16
#else
#define VW 16
#define MT_MAX 4
#define NG_WIDE 1
#define NG_GEMV_ROWS 1
#define ACC_IN_MEMORY 0
#define NUM_VREGS 16
#endif

#define LANES 16
#define MT_ALL (MT_MAX > 6 ? 12 : 6) /* rows of the largest tile instantiated */
#define QK 32
#define PANELS_PER_UNIT 4 /* n is padded to a multiple of LANES * PANELS_PER_UNIT */
#define GROUPS_PER_PANEL (LANES / VW)
#define NG_GEMV 4 /* groups per tile for one row: independent accumulators hide the FMA latency */
#define MCHUNK 96 /* rows that share one pass over the weights */
#ifndef PF_BLOCKS
#define PF_BLOCKS 4 /* prefetch distance in blocks */
#endif

enum { QL_F32 = 0, QL_F16 = 1, QL_BF16 = 2, QL_Q8_0 = 3, QL_Q4_0 = 4, QL_Q4_1 = 5, QL_NUM_FORMATS = 6 };

/* ---- vectors of VW float32 lanes ---- */

#if defined(__AVX512F__)
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_loadf(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vf_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vf_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif VW == 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_loadf(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vf_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vf_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
#else
#pragma GCC diagnostic ignored "-Wpsabi" /* vectors passed between static inline functions only */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
static inline vf vf_zero(void) { return (vf){0}; }
static inline vf vf_set1(float a) { return (vf){0} + a; }
static inline vf vf_fma(vf a, vf b, vf c) { return a * b + c; } /* two roundings: see the header */
static inline vf vf_mul(vf a, vf b) { return a * b; }
static inline vf vf_loadf(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vf_f16(const uint16_t *p) { vf v; for (int i = 0; i < VW; i++) v[i] = half_to_float(p[i]); return v; }
static inline vf vf_bf16(const uint16_t *p) { vf v; for (int i = 0; i < VW; i++) v[i] = widen(p[i]); return v; }
static inline vf vf_i8(const int8_t *p) { vi q; for (int i = 0; i < VW; i++) q[i] = p[i]; return __builtin_convertvector(q, vf); }
static inline void vf_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    vi q;
    for (int i = 0; i < VW; i++) q[i] = p[i];
    *lo = __builtin_convertvector(q & 15, vf);
    *hi = __builtin_convertvector(q >> 4, vf);
}
#endif

/* ---- formats ---- */

static int is_block_format(int fmt) { return fmt >= QL_Q8_0; }

/* Bytes of one 32-input block of one panel (block formats), or of one input of a panel (float formats). */
static int64_t panel_step_bytes(int fmt) {
    switch (fmt) {
        case QL_F32: return LANES * 4;
        case QL_F16: case QL_BF16: return LANES * 2;
        case QL_Q8_0: return LANES * 2 + QK * LANES;
        case QL_Q4_0: return LANES * 2 + QK / 2 * LANES;
        case QL_Q4_1: return LANES * 4 + QK / 2 * LANES;
    }
    return 0;
}

/* Bytes of one row of the weight as GGUF stores it. */
static int64_t source_row_bytes(int fmt, int64_t k) {
    switch (fmt) {
        case QL_F32: return k * 4;
        case QL_F16: case QL_BF16: return k * 2;
        case QL_Q8_0: return k / QK * 34;
        case QL_Q4_0: return k / QK * 18;
        case QL_Q4_1: return k / QK * 20;
    }
    return 0;
}

static int64_t padded_n(int64_t n) {
    const int64_t unit = LANES * PANELS_PER_UNIT;
    return (n + unit - 1) / unit * unit;
}

static int64_t panel_bytes(int fmt, int64_t k) { return panel_step_bytes(fmt) * (is_block_format(fmt) ? k / QK : k); }

/* 0 if (fmt, k) can be served, else an error code the wrapper turns into a message. */
int qlinear_check(int fmt, int64_t k) {
    if (fmt < 0 || fmt >= QL_NUM_FORMATS) return 1;
    if (k <= 0 || (is_block_format(fmt) && k % QK != 0)) return 2;
    return 0;
}

int64_t qlinear_packed_nbytes(int fmt, int64_t n, int64_t k) { return padded_n(n) / LANES * panel_bytes(fmt, k); }

int64_t qlinear_source_row_bytes(int fmt, int64_t k) { return source_row_bytes(fmt, k); }

/* Pack GGUF rows `src` ([n] rows of source_row_bytes each) into `dst` (qlinear_packed_nbytes, zeroed here). */
void qlinear_pack(int fmt, const uint8_t *src, int64_t n, int64_t k, uint8_t *dst) {
    const int64_t row_bytes = source_row_bytes(fmt, k), step = panel_step_bytes(fmt), pbytes = panel_bytes(fmt, k);
    memset(dst, 0, (size_t)qlinear_packed_nbytes(fmt, n, k));
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = src + r * row_bytes;
        uint8_t *panel = dst + r / LANES * pbytes;
        const int64_t lane = r % LANES;
        if (!is_block_format(fmt)) {
            const int64_t es = step / LANES;
            for (int64_t i = 0; i < k; i++) memcpy(panel + i * step + lane * es, row + i * es, (size_t)es);
            continue;
        }
        for (int64_t b = 0; b < k / QK; b++) {
            uint8_t *blk = panel + b * step;
            if (fmt == QL_Q8_0) {
                const uint8_t *s = row + b * 34;
                memcpy(blk + lane * 2, s, 2);
                for (int j = 0; j < QK; j++) blk[LANES * 2 + j * LANES + lane] = s[2 + j];
            } else {
                const int has_min = fmt == QL_Q4_1, hdr = has_min ? 4 : 2;
                const uint8_t *s = row + b * (hdr + QK / 2);
                memcpy(blk + lane * 2, s, 2);
                if (has_min) memcpy(blk + LANES * 2 + lane * 2, s + 2, 2);
                for (int j = 0; j < QK / 2; j++) blk[LANES * hdr + j * LANES + lane] = s[hdr + j];
            }
        }
    }
}

/* ---- the tile: rows [0, MT) of x times NG vector groups of one run of panels ----
 *
 * Per 32-input block, each t[i][g] is one chain of 32 dependent FMAs; a tile keeps MT x NG
 * of them in registers, enough independent chains to cover the FMA latency (two pipes x
 * four cycles: 8 or more). Each expanded weight vector (bytes -> int32 -> float: a few
 * operations) feeds MT FMAs, so the more rows a tile holds, the less the expansion costs.
 * The values of GC groups are expanded at once (`group_chunk`), then every row's two
 * broadcasts of x meet all GC of them; with GC = NG each x is broadcast once per input.
 *
 * With 16 vector registers (AVX2) the accumulators of the block formats live in a small
 * L1-resident array instead (ACC_IN_MEMORY: one load and store per block and output vector),
 * so that registers hold t for up to 5 rows x 2 groups (10), the expanded values of both groups
 * (4) and the two broadcasts: 16 (6 rows spill; one thread, SmolLM2's linears, AVX2: 4 rows
 * 39 GMAC/s, 8 rows 41, 64 rows 46, against 28, 34, 41 with 3 rows and acc in registers).
 * With 32 registers (AVX-512) the accumulators live in L1 too, so that a tile holds t for up to
 * 12 rows x 2 groups (24) beside the expanded values of both groups (4) and the broadcasts, and
 * tiles of 2 to 6 rows take 4 groups (NG_GEMV_ROWS: up to 16 chains of t, the values of 4 or 2
 * groups expanded at once). One thread, SmolLM2's linears, Zen 4: 4 rows 37 GMAC/s, 8 rows 42,
 * 16 rows 43, 64 rows 47, against 34, 38, 43, 46 with 6 rows x 2 groups and acc in registers
 * (and the block-unpacking path below from 16 rows). */

/* Group g of a panel run: panel g / GROUPS_PER_PANEL, lanes (g % GROUPS_PER_PANEL) * VW. */
#define GROUP_PANEL(w, g, pbytes) ((w) + (int64_t)((g) / GROUPS_PER_PANEL) * (pbytes))
#define GROUP_LANE(g) (((g) % GROUPS_PER_PANEL) * VW)

/* Groups whose values a block-format tile expands at once. With ACC_IN_MEMORY (AVX2, AVX-512): the most that
 * fit in the NUM_VREGS registers beside t and the two broadcasts of x (AVX-512, one group at a time instead:
 * 4 rows 35 vs 37 GMAC/s, 12 rows 31 vs 42). Generic: one at a time; the order of each chain's FMAs is the
 * same either way. */
static inline int group_chunk(int MT, int NG) {
    int gc = NG;
    while (gc > 1 && (!ACC_IN_MEMORY || MT * NG + 2 * gc + 2 > NUM_VREGS)) gc /= 2;
    return gc;
}

static inline __attribute__((always_inline)) void tile(const int fmt, const int MT, const int NG, const float *x,
                                                       int64_t ldx, const float *xsum, int64_t ldxs, const uint8_t *w,
                                                       int64_t pbytes, int64_t k, float *y, int64_t ldy, int64_t col0,
                                                       int64_t n) {
    const int mem = ACC_IN_MEMORY && is_block_format(fmt);
    const int GC = group_chunk(MT, NG);
    vf acc[MT_ALL][NG_GEMV]; /* sized for every instantiated tile; only [MT][NG] is used */
    float acc_mem[MT_ALL][NG_GEMV][VW] __attribute__((aligned(64)));
    for (int i = 0; i < MT; i++)
        for (int g = 0; g < NG; g++) {
            acc[i][g] = vf_zero();
            if (mem) vf_store(acc_mem[i][g], acc[i][g]);
        }
    const int64_t step = panel_step_bytes(fmt);
    if (!is_block_format(fmt)) {
        for (int64_t kk = 0; kk < k; kk++) {
            for (int g = 0; g < NG; g++) {
                const uint8_t *p = GROUP_PANEL(w, g, pbytes) + kk * step;
                vf wv;
                if (fmt == QL_F32) wv = vf_loadf((const float *)p + GROUP_LANE(g));
                else if (fmt == QL_F16) wv = vf_f16((const uint16_t *)p + GROUP_LANE(g));
                else wv = vf_bf16((const uint16_t *)p + GROUP_LANE(g));
                for (int i = 0; i < MT; i++) acc[i][g] = vf_fma(vf_set1(x[i * ldx + kk]), wv, acc[i][g]);
            }
        }
    } else {
        const int hdr = fmt == QL_Q4_1 ? 4 : 2; /* header bytes per lane: d (and m) */
        for (int64_t b = 0; b < k / QK; b++) {
            const float *xb = x + b * QK;
            vf t[MT_ALL][NG_GEMV];
            for (int i = 0; i < MT; i++)
                for (int g = 0; g < NG; g++) t[i][g] = vf_zero();
            if (PF_BLOCKS > 0 && b + PF_BLOCKS < k / QK) /* the weight stream, a few blocks ahead */
                for (int g = 0; g < NG; g += GROUPS_PER_PANEL)
                    for (int64_t off = 0; off < step; off += 64)
                        __builtin_prefetch(GROUP_PANEL(w, g, pbytes) + (b + PF_BLOCKS) * step + off, 0, 0);
            if (fmt == QL_Q8_0) {
                for (int j = 0; j < QK; j++)
                    for (int g0 = 0; g0 < NG; g0 += GC) {
                        vf q[NG_GEMV];
                        for (int g = g0; g < g0 + GC; g++)
                            q[g] = vf_i8((const int8_t *)GROUP_PANEL(w, g, pbytes) + b * step + LANES * 2 +
                                         j * LANES + GROUP_LANE(g));
                        for (int i = 0; i < MT; i++) {
                            const vf xj = vf_set1(xb[i * ldx + j]);
                            for (int g = g0; g < g0 + GC; g++) t[i][g] = vf_fma(xj, q[g], t[i][g]);
                        }
                    }
            } else if (GC == 1) { /* generic: the simpler form */
                for (int j = 0; j < QK / 2; j++)
                    for (int g = 0; g < NG; g++) {
                        const uint8_t *blk = GROUP_PANEL(w, g, pbytes) + b * step;
                        vf lo, hi;
                        vf_nibbles(blk + LANES * hdr + j * LANES + GROUP_LANE(g), &lo, &hi);
                        for (int i = 0; i < MT; i++) {
                            t[i][g] = vf_fma(vf_set1(xb[i * ldx + j]), lo, t[i][g]);
                            t[i][g] = vf_fma(vf_set1(xb[i * ldx + j + QK / 2]), hi, t[i][g]);
                        }
                    }
            } else {
                for (int j = 0; j < QK / 2; j++)
                    for (int g0 = 0; g0 < NG; g0 += GC) {
                        vf lo[NG_GEMV], hi[NG_GEMV];
                        for (int g = g0; g < g0 + GC; g++)
                            vf_nibbles(GROUP_PANEL(w, g, pbytes) + b * step + LANES * hdr + j * LANES + GROUP_LANE(g),
                                       &lo[g], &hi[g]);
                        for (int i = 0; i < MT; i++) {
                            const vf xl = vf_set1(xb[i * ldx + j]), xh = vf_set1(xb[i * ldx + j + QK / 2]);
                            for (int g = g0; g < g0 + GC; g++) {
                                t[i][g] = vf_fma(xl, lo[g], t[i][g]);
                                t[i][g] = vf_fma(xh, hi[g], t[i][g]);
                            }
                        }
                    }
            }
            for (int g = 0; g < NG; g++) {
                const uint8_t *blk = GROUP_PANEL(w, g, pbytes) + b * step;
                const vf d = vf_f16((const uint16_t *)blk + GROUP_LANE(g));
                const vf m = fmt == QL_Q4_1   ? vf_f16((const uint16_t *)blk + LANES + GROUP_LANE(g))
                             : fmt == QL_Q4_0 ? vf_mul(d, vf_set1(-8.0f))
                                              : vf_zero(); /* Q8_0: unused */
                for (int i = 0; i < MT; i++) {
                    vf a = mem ? vf_loadf(acc_mem[i][g]) : acc[i][g];
                    a = vf_fma(t[i][g], d, a);
                    if (fmt != QL_Q8_0) a = vf_fma(m, vf_set1(xsum[i * ldxs + b]), a);
                    if (mem) vf_store(acc_mem[i][g], a);
                    else acc[i][g] = a;
                }
            }
        }
    }
    for (int g = 0; g < NG; g++) {
        const int64_t col = col0 + (g / GROUPS_PER_PANEL) * LANES + GROUP_LANE(g);
        if (col >= n) continue;
        for (int i = 0; i < MT; i++) {
            const vf a = mem ? vf_loadf(acc_mem[i][g]) : acc[i][g];
            if (col + VW <= n) {
                vf_store(y + i * ldy + col, a);
            } else {
                float tail[VW];
                vf_store(tail, a);
                memcpy(y + i * ldy + col, tail, (size_t)(n - col) * sizeof tail[0]);
            }
        }
    }
}

/* One specialised body per (format, rows, groups), so t (and acc, where not in L1) stay in registers. */
#define TILE_ARGS x, ldx, xsum, ldxs, w, pbytes, k, y, ldy, col0, n
#define TILE_FN(F, MT, NG)                                                                                          \
    static void tile_##F##_##MT##_##NG(const float *x, int64_t ldx, const float *xsum, int64_t ldxs,               \
                                       const uint8_t *w, int64_t pbytes, int64_t k, float *y, int64_t ldy,         \
                                       int64_t col0, int64_t n) {                                                  \
        tile(F, MT, NG, TILE_ARGS);                                                                                 \
    }
#define TILES_FOR(F)                                                                                              \
    TILE_FN(F, 1, 1) TILE_FN(F, 1, 2) TILE_FN(F, 1, 4) TILE_FN(F, 2, 1) TILE_FN(F, 2, 2) TILE_FN(F, 3, 1)          \
    TILE_FN(F, 3, 2) TILE_FN(F, 4, 1) TILE_FN(F, 4, 2) TILE_FN(F, 5, 1) TILE_FN(F, 5, 2) TILE_FN(F, 6, 1)          \
    TILE_FN(F, 6, 2) TILES_MORE(F)
/* AVX-512: tiles of up to 12 rows, and of 2-6 rows x NG_GEMV groups */
#if MT_MAX > 6
#define TILES_MORE(F)                                                                                             \
    TILE_FN(F, 2, 4) TILE_FN(F, 3, 4) TILE_FN(F, 4, 4) TILE_FN(F, 5, 4) TILE_FN(F, 6, 4) TILE_FN(F, 7, 1)          \
    TILE_FN(F, 7, 2) TILE_FN(F, 8, 1) TILE_FN(F, 8, 2) TILE_FN(F, 9, 1) TILE_FN(F, 9, 2) TILE_FN(F, 10, 1)         \
    TILE_FN(F, 10, 2) TILE_FN(F, 11, 1) TILE_FN(F, 11, 2) TILE_FN(F, 12, 1) TILE_FN(F, 12, 2)
#define TILE_ROW_MORE(F)                                                                                          \
    , {tile_##F##_7_1, tile_##F##_7_2, 0, 0}, {tile_##F##_8_1, tile_##F##_8_2, 0, 0},                             \
        {tile_##F##_9_1, tile_##F##_9_2, 0, 0}, {tile_##F##_10_1, tile_##F##_10_2, 0, 0},                         \
        {tile_##F##_11_1, tile_##F##_11_2, 0, 0}, {tile_##F##_12_1, tile_##F##_12_2, 0, 0}
#define T4(F, MT) tile_##F##_##MT##_4
#else
#define TILES_MORE(F)
#define TILE_ROW_MORE(F)
#define T4(F, MT) 0
#endif
TILES_FOR(QL_F32)
TILES_FOR(QL_F16)
TILES_FOR(QL_BF16)
TILES_FOR(QL_Q8_0)
TILES_FOR(QL_Q4_0)
TILES_FOR(QL_Q4_1)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, const uint8_t *, int64_t, int64_t, float *,
                        int64_t, int64_t, int64_t);

#define TILE_ROW(F)                                                                                               \
    {{tile_##F##_1_1, tile_##F##_1_2, 0, tile_##F##_1_4}, {tile_##F##_2_1, tile_##F##_2_2, 0, T4(F, 2)},          \
     {tile_##F##_3_1, tile_##F##_3_2, 0, T4(F, 3)}, {tile_##F##_4_1, tile_##F##_4_2, 0, T4(F, 4)},                 \
     {tile_##F##_5_1, tile_##F##_5_2, 0, T4(F, 5)}, {tile_##F##_6_1, tile_##F##_6_2, 0, T4(F, 6)} TILE_ROW_MORE(F)}
/* [format][rows - 1][groups - 1] */
static const tile_fn TILES[QL_NUM_FORMATS][MT_ALL][4] = {TILE_ROW(QL_F32),  TILE_ROW(QL_F16),  TILE_ROW(QL_BF16),
                                                         TILE_ROW(QL_Q8_0), TILE_ROW(QL_Q4_0), TILE_ROW(QL_Q4_1)};

/* Block sums of x for the Q4 formats: xsum[i * nb + b] = x[i, 32b] + ... + x[i, 32b + 31], in order. */
static void block_sums(const float *x, int64_t ldx, int64_t m, int64_t k, float *xsum) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int j = 0; j < QK; j++) s += x[i * ldx + b * QK + j];
            xsum[i * nb + b] = s;
        }
}

/* ---- many rows, block formats: each block's values are unpacked once into L1 (as floats) ----
 *
 * The tiles above unpack every block once per tile of rows; with many rows (prefill, large
 * decode batches) that unpacking, and the registers it holds, bound the multiply-adds. Here the
 * 4/8-bit values of GEMM_KC blocks of a panel are converted once per call into a float buffer in
 * L1, and tiles of GEMM_MT rows sweep those blocks: per input, two loads of unpacked values and
 * one broadcast of x per row feed GEMM_MT x GEMM_NG independent chains of t (the BLIS shape for
 * 16 registers at AVX2: 6 rows x 16 columns), and the accumulators live in L1. The arithmetic is
 * the tiles' exactly (same t order, same acc updates), so the bits are the same (tested).
 * `gemm_min_rows` says from how many rows a format takes this path. */

#if VW == 8
#define GEMM_MT 6 /* 12 chains of t: fewer leave the FMA latency exposed (4 rows: 30 GMAC/s, 6: 41) */
/* Q4 formats from 28 rows; Q8_0 never (its tiles expand one byte per value, no nibble split, and stay
 * faster). One thread, Zen 3, interleaved best-of-7 against the tiles over SmolLM2's 121 linears
 * (python -m asyncpp.bench.linears shapes): 12 / 16 / 20 / 24 rows 0.91-1.00x, 28 / 32 / 64 / 256 rows
 * 1.04 / 1.04-1.05 / 1.08 / 1.04x (36.6 GMAC/s at 32 rows, 38.4 at 64, of a 46-48 FMA peak); the Q8_0
 * head alone at 16 / 32 rows 31.7 / 33.3 GMAC/s against the tiles' 37.2 / 36.9. */
#define GEMM_MIN_ROWS_Q4 28
#define GEMM_MIN_ROWS_Q8 INT64_MAX
#elif VW == 16 && defined(__AVX512F__)
#define GEMM_MT 12
/* Never: the tiles (12 rows x 2 groups, acc in L1) are as fast at 16 rows and more (one thread,
 * SmolLM2's linears, Zen 4: 16 rows 43 vs 43 GMAC/s, 64: 47 vs 46, 256: 45 vs 44). */
#define GEMM_MIN_ROWS_Q4 INT64_MAX
#define GEMM_MIN_ROWS_Q8 INT64_MAX
#else
#define GEMM_MT 4
#define GEMM_MIN_ROWS_Q4 16 /* below, the tiles are faster */
#define GEMM_MIN_ROWS_Q8 16
#endif
#define GEMM_KC 8 /* blocks unpacked at a time: 16 KB of floats, in L1 beside a tile's x and acc */
#define GEMM_NG GROUPS_PER_PANEL /* one panel of 16 columns per unit */

/* Block b of one panel -> q[j][lane] (j = 0..31, in the tiles' j / j + 16 split: q[j] for input j). */
static inline void unpack_block(int fmt, const uint8_t *blk, float *q) {
    const int hdr = fmt == QL_Q4_1 ? 4 : 2;
    for (int j = 0; j < QK / 2; j++)
        for (int g = 0; g < GROUPS_PER_PANEL; g++) {
            vf lo, hi;
            if (fmt == QL_Q8_0) {
                const int8_t *v = (const int8_t *)blk + LANES * 2 + g * VW;
                lo = vf_i8(v + j * LANES);
                hi = vf_i8(v + (j + QK / 2) * LANES);
            } else {
                vf_nibbles(blk + LANES * hdr + j * LANES + g * VW, &lo, &hi);
            }
            vf_store(q + j * LANES + g * VW, lo);
            vf_store(q + (j + QK / 2) * LANES + g * VW, hi);
        }
}

static inline __attribute__((always_inline)) void gemm_rows(const int fmt, const int mt, const float *x, int64_t ldx,
                                                            const float *q, const float *xsum_b, int64_t ldxs,
                                                            const uint8_t *blk, int first, float *acc) {
    vf t[12][GEMM_NG]; /* sized for every instantiated row count; only [mt] is used */
    for (int i = 0; i < mt; i++)
        for (int g = 0; g < GEMM_NG; g++) t[i][g] = vf_zero();
    if (fmt == QL_Q8_0) /* inputs in order, as the tiles sum them */
        for (int j = 0; j < QK; j++)
            for (int i = 0; i < mt; i++) {
                const vf xj = vf_set1(x[i * ldx + j]);
                for (int g = 0; g < GEMM_NG; g++) t[i][g] = vf_fma(xj, vf_loadf(q + j * LANES + g * VW), t[i][g]);
            }
#if VW == 8
    else /* Q4: inputs j and j + 16 in turn, the nibbles of one byte; one input's values in registers at a
          * time (both inputs' at once spilled t at AVX2), the loop unrolled (a computed index cost 1.5x) */
#pragma GCC unroll 16
        for (int j = 0; j < QK / 2; j++)
            for (int h = 0; h < 2; h++) {
                const int jx = j + h * (QK / 2);
                vf qv[GEMM_NG];
                for (int g = 0; g < GEMM_NG; g++) qv[g] = vf_loadf(q + jx * LANES + g * VW);
                for (int i = 0; i < mt; i++) {
                    const vf xj = vf_set1(x[i * ldx + jx]);
                    for (int g = 0; g < GEMM_NG; g++) t[i][g] = vf_fma(xj, qv[g], t[i][g]);
                }
            }
#else /* the same order, both inputs' values loaded at once (the generic build's wide vectors spill otherwise) */
    else
        for (int j = 0; j < QK / 2; j++) {
            vf lo[GEMM_NG], hi[GEMM_NG];
            for (int g = 0; g < GEMM_NG; g++) {
                lo[g] = vf_loadf(q + j * LANES + g * VW);
                hi[g] = vf_loadf(q + (j + QK / 2) * LANES + g * VW);
            }
            for (int i = 0; i < mt; i++) {
                const vf xl = vf_set1(x[i * ldx + j]), xh = vf_set1(x[i * ldx + j + QK / 2]);
                for (int g = 0; g < GEMM_NG; g++) {
                    t[i][g] = vf_fma(xl, lo[g], t[i][g]);
                    t[i][g] = vf_fma(xh, hi[g], t[i][g]);
                }
            }
        }
#endif
    for (int g = 0; g < GEMM_NG; g++) {
        const vf d = vf_f16((const uint16_t *)blk + g * VW);
        const vf m = fmt == QL_Q4_1 ? vf_f16((const uint16_t *)blk + LANES + g * VW) : vf_mul(d, vf_set1(-8.0f));
        for (int i = 0; i < mt; i++) {
            float *a_mem = acc + i * LANES + g * VW;
            vf a = first ? vf_zero() : vf_loadf(a_mem);
            a = vf_fma(t[i][g], d, a);
            if (fmt != QL_Q8_0) a = vf_fma(m, vf_set1(xsum_b[i * ldxs]), a);
            vf_store(a_mem, a);
        }
    }
}

#define GEMM_CASE(F, R) \
    case R: gemm_rows(F, R, x, ldx, q, xsum_b, ldxs, blk, first, acc); break;
#define GEMM_FN(F)                                                                                                  \
    static void gemm_##F(int mt, const float *x, int64_t ldx, const float *q, const float *xsum_b, int64_t ldxs,   \
                         const uint8_t *blk, int first, float *acc) {                                             \
        switch (mt) {                                                                                              \
            GEMM_CASE(F, 1) GEMM_CASE(F, 2) GEMM_CASE(F, 3) GEMM_CASE(F, 4) GEMM_CASE(F, 5) GEMM_CASE(F, 6)         \
            GEMM_CASE(F, 7) GEMM_CASE(F, 8) GEMM_CASE(F, 9) GEMM_CASE(F, 10) GEMM_CASE(F, 11) GEMM_CASE(F, 12)      \
        }                                                                                                          \
    }
GEMM_FN(QL_Q8_0)
GEMM_FN(QL_Q4_0)
GEMM_FN(QL_Q4_1)

/* Rows [0, rows) times one panel (16 columns) of a block format. `acc` is [rows][LANES] scratch, `q` holds the
 * unpacked values of GEMM_KC blocks ([GEMM_KC][QK][LANES] floats). */
static void gemm_panel(int fmt, const float *x, int64_t ldx, int64_t rows, const float *xsum, int64_t nb,
                       const uint8_t *panel, int64_t k, float *acc, float *q, float *y, int64_t ldy, int64_t col0,
                       int64_t n) {
    const int64_t step = panel_step_bytes(fmt), num_tiles = (rows + GEMM_MT - 1) / GEMM_MT;
    for (int64_t b0 = 0; b0 < k / QK; b0 += GEMM_KC) {
        const int64_t b1 = b0 + GEMM_KC < k / QK ? b0 + GEMM_KC : k / QK;
        for (int64_t b = b0; b < b1; b++) unpack_block(fmt, panel + b * step, q + (b - b0) * QK * LANES);
        for (int64_t t = 0; t < num_tiles; t++) {
            const int64_t i0 = t * rows / num_tiles, i1 = (t + 1) * rows / num_tiles;
            float *a = acc + i0 * LANES;
            for (int64_t b = b0; b < b1; b++) {
                const uint8_t *blk = panel + b * step;
                const float *xi = x + i0 * ldx + b * QK, *xs = xsum != NULL ? xsum + i0 * nb + b : NULL;
                const float *qb = q + (b - b0) * QK * LANES;
                if (fmt == QL_Q8_0) gemm_QL_Q8_0((int)(i1 - i0), xi, ldx, qb, xs, nb, blk, b == 0, a);
                else if (fmt == QL_Q4_0) gemm_QL_Q4_0((int)(i1 - i0), xi, ldx, qb, xs, nb, blk, b == 0, a);
                else gemm_QL_Q4_1((int)(i1 - i0), xi, ldx, qb, xs, nb, blk, b == 0, a);
            }
        }
    }
    const int64_t width = n - col0 < LANES ? n - col0 : LANES;
    for (int64_t i = 0; i < rows && width > 0; i++) memcpy(y + i * ldy + col0, acc + i * LANES, (size_t)width * sizeof(float));
}

static int64_t gemm_min_rows(int fmt) { return fmt == QL_Q8_0 ? GEMM_MIN_ROWS_Q8 : GEMM_MIN_ROWS_Q4; }

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) @ w^T, w packed by qlinear_pack. Returns 0, or -1 if
 * out of memory. */
int qlinear(int fmt, const float *x, int64_t ldx, int64_t m, const uint8_t *packed, int64_t n, int64_t k, float *y,
            int64_t ldy, int num_threads) {
    if (m <= 0) return 0;
    const int64_t pbytes = panel_bytes(fmt, k), nb = k / QK;
    const int needs_sums = fmt == QL_Q4_0 || fmt == QL_Q4_1;
    float *xsum = needs_sums ? malloc((size_t)(m * nb) * sizeof(float)) : NULL;
    if (needs_sums && xsum == NULL) return -1;
    if (needs_sums) block_sums(x, ldx, m, k, xsum);
    const int64_t num_groups = padded_n(n) / VW;
    if (is_block_format(fmt) && m >= gemm_min_rows(fmt)) {
        const int64_t num_panels = padded_n(n) / LANES;
        int status = 0;
#pragma omp parallel num_threads(num_threads > 1 && num_panels > 1 ? num_threads : 1)
        {
            float *acc = aligned_alloc(64, (size_t)(MCHUNK * LANES) * sizeof(float));
            float *q = aligned_alloc(64, (size_t)(GEMM_KC * QK * LANES) * sizeof(float));
            if (acc == NULL || q == NULL) {
#pragma omp atomic write
                status = -1;
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < num_panels; p++) {
                if (acc == NULL || q == NULL) continue;
                for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
                    const int64_t rows = m - m0 < MCHUNK ? m - m0 : MCHUNK;
                    gemm_panel(fmt, x + m0 * ldx, ldx, rows, needs_sums ? xsum + m0 * nb : NULL, nb,
                               packed + p * pbytes, k, acc, q, y + m0 * ldy, ldy, p * LANES, n);
                }
            }
            free(acc);
            free(q);
        }
        free(xsum);
        return status;
    }
    for (int64_t m0 = 0; m0 < m; m0 += MCHUNK) {
        const int64_t rows = m - m0 < MCHUNK ? m - m0 : MCHUNK;
        const int64_t num_tiles = (rows + MT_MAX - 1) / MT_MAX;
        const int ng = rows <= NG_GEMV_ROWS ? NG_GEMV : NG_WIDE; /* divides num_groups: n is padded to 4 panels */
        const int64_t num_units = num_groups / ng;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && num_units > 1)
        for (int64_t u = 0; u < num_units; u++) {
            const int64_t p0 = u * ng / GROUPS_PER_PANEL; /* ng is a whole number of panels */
            for (int64_t t = 0; t < num_tiles; t++) { /* tiles of near-equal size: 16 rows = 6 + 5 + 5 */
                const int64_t i0 = m0 + t * rows / num_tiles, i1 = m0 + (t + 1) * rows / num_tiles;
                TILES[fmt][i1 - i0 - 1][ng - 1](x + i0 * ldx, ldx, needs_sums ? xsum + i0 * nb : NULL, nb,
                                                packed + p0 * pbytes, pbytes, k, y + i0 * ldy, ldy, p0 * LANES, n);
            }
        }
    }
    free(xsum);
    return 0;
}

/* out [num_ids, k] = rows `ids` of the weight packed by qlinear_pack, dequantized as GGUF defines it
 * (d * q, d * (q - 8), d * q + m in float32): the embedding lookup of a tied, packed weight. */
void qlinear_dequant_rows(int fmt, const uint8_t *packed, int64_t k, const int64_t *ids, int64_t num_ids, float *out) {
    const int64_t step = panel_step_bytes(fmt), pbytes = panel_bytes(fmt, k);
    for (int64_t r = 0; r < num_ids; r++) {
        const uint8_t *panel = packed + ids[r] / LANES * pbytes;
        const int64_t lane = ids[r] % LANES;
        float *o = out + r * k;
        if (!is_block_format(fmt)) {
            for (int64_t i = 0; i < k; i++) {
                const uint8_t *p = panel + i * step;
                if (fmt == QL_F32) memcpy(o + i, p + lane * 4, 4);
                else {
                    uint16_t h;
                    memcpy(&h, p + lane * 2, 2);
                    o[i] = fmt == QL_F16 ? half_to_float(h) : widen(h);
                }
            }
            continue;
        }
        for (int64_t b = 0; b < k / QK; b++) {
            const uint8_t *blk = panel + b * step;
            uint16_t h;
            memcpy(&h, blk + lane * 2, 2);
            const float d = half_to_float(h);
            float *ob = o + b * QK;
            if (fmt == QL_Q8_0) {
                for (int j = 0; j < QK; j++) ob[j] = d * (float)(int8_t)blk[LANES * 2 + j * LANES + lane];
                continue;
            }
            const int hdr = fmt == QL_Q4_1 ? 4 : 2;
            float mn = 0.0f;
            if (fmt == QL_Q4_1) {
                memcpy(&h, blk + LANES * 2 + lane * 2, 2);
                mn = half_to_float(h);
            }
            for (int j = 0; j < QK / 2; j++) {
                const uint8_t byte = blk[LANES * hdr + j * LANES + lane];
                const float lo = (float)(byte & 15), hi = (float)(byte >> 4);
                if (fmt == QL_Q4_1) {
                    ob[j] = d * lo + mn;
                    ob[j + QK / 2] = d * hi + mn;
                } else {
                    ob[j] = d * (lo - 8.0f);
                    ob[j + QK / 2] = d * (hi - 8.0f);
                }
            }
        }
    }
}
