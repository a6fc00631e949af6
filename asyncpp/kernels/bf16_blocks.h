/* GGUF blocks for linear_bf16.c, which includes this file once (it uses the .c's PANEL, NB, BLOCK,
 * out_rows and store_panel): the packed layout, the streaming tiles and the expanded path of many rows. */

#ifndef ASYNCPP_BF16_BLOCKS_H
#define ASYNCPP_BF16_BLOCKS_H

/* ---- GGUF blocks (Q8_0, Q4_0, Q4_1): bfloat16 activations times the exact quantized weights ----
 *
 * A GGUF block holds 32 inputs of one output column as small integers q with a float16 scale d
 * (and, in Q4_1, a float16 offset m): w = d * q (Q8_0: q in -128..127; Q4_0: q - 8 with q in
 * 0..15) or w = d * q + m (Q4_1). Every q is exact in bfloat16, and so is every product of a
 * bfloat16 input and a q in float32. So the kernel never forms w: per block it sums x * q with
 * dpbf16 (exact products, one float32 sum in input order), then adds d times that sum and, for
 * Q4_1, m times the block's float32 sum of x. The weights are exactly the file's (no bfloat16
 * rounding of w); only the activations are bfloat16, and the result is rounded to bfloat16 once.
 *
 * Expanding q to bfloat16 is cheap: Q4 nibbles index a 32-entry table of bfloat16 integers
 * (vpermw), Q8_0 goes through float32. Layout, per BLOCK of 64 columns, per 32-input block, per
 * panel of 16 columns: [d: 16 x fp16][m: 16 x fp16, Q4_1][values]. Values, Q4: 8 chunks of 32
 * bytes; in chunk r, byte 2c + t holds column c's input 4r + t in its low nibble (pair 2r) and
 * input 4r + 2 + t in its high one (pair 2r + 1). Q8_0: 16 chunks of 32 int8, byte 2c + t of
 * chunk p holding column c's input 2p + t. Either way one chunk widens to dpbf16's operand
 * (dword lane c = column c, inputs of one pair) with no shuffle.
 *
 * Rows go in tiles (Q4: up to 8 rows, or up to 6 in a batch of more than 8; Q8_0: up to 16, its
 * expansion costing more); a tile
 * expands the q in registers as it streams a BLOCK, two pairs at a time, and each expanded q
 * feeds all the tile's rows. Per 32-input block, `part` (registers) sums x * q for mt rows x np
 * panels; then acc += d * part (+ m * sx). acc is either in registers too (2 * mt * np zmm: 1-2
 * rows x 4 panels, 3-4 x 2, up to 12 x 1; Q4 5-6 rows x 2, 24 zmm with the sums) or, for the
 * shapes that would not fit, in an
 * L1-resident array (Q4: 3-4 rows x 4 panels, 7 x 2; Q8_0: 13-16 x 1), which gives every
 * shape at least 8 independent dpbf16 chains (their latency is 6 cycles) and more rows per
 * expanded q. Each (format, rows) shape is its own function, aligned to a cache line: its
 * placement otherwise moved the 1-row speed by ~5%. The first tile of a BLOCK prefetches the
 * blocks ahead into L2 (one row reads them at DRAM speed); the next tiles find the BLOCK in L2
 * and do not prefetch it again (repeated prefetches of cached lines cost Q8_0 ~5%). Every
 * output is summed in one order (pairs in order within a block, then d, then m; blocks in
 * order), whatever the shape, so a row's result does not depend on the batch, the tile or the
 * thread count. */

enum { QB_Q8_0 = 3, QB_Q4_0 = 4, QB_Q4_1 = 5 }; /* qlinear's format codes */
#define QK 32
#define QPAIRS (QK / 2)
#define QB_TILE_ROWS_Q4 8   /* rows per tile at most, Q4 */
#define QB_TILE_ROWS_Q4_MANY 6 /* ... in a batch of more than QB_TILE_ROWS_Q4 rows: sums in registers */
#define QB_TILE_ROWS_Q8 16  /* and Q8_0 */
#define QB_TILE_ROWS 16     /* the larger */
#define QB_PREFETCH_AHEAD 12 /* input blocks ahead that the tiles prefetch into L2 (Q4_1: 15 KB, DRAM's latency) */

static int64_t qb_header_bytes(int fmt) { return fmt == QB_Q4_1 ? PANEL * 4 : PANEL * 2; }

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
    const int p = j / 2, t = j % 2;
    if (fmt == QB_Q8_0) {
        *high_nibble = 0;
        return p * 32 + 2 * lane + t;
    }
    *high_nibble = p % 2;
    return p / 2 * 32 + 2 * lane + t;
}

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

/* The 32-entry table of Q4 values as bfloat16, indexed by a byte's low 5 bits (entry i: i & 15, or
 * (i & 15) - 8 for Q4_0), so a whole byte can index it for its low nibble. */
static __m512i qb_q4_table(int fmt) {
    uint16_t table[32];
    for (int i = 0; i < 32; i++) table[i] = narrow((float)((i & 15) - (fmt == QB_Q4_0 ? 8 : 0)));
    return _mm512_loadu_si512(table);
}

/* Pairs p and p + 1 (p even: inputs 2p .. 2p + 3) of a panel block's values as dpbf16's operands
 * (Q4: one chunk, its low nibbles for pair p and its high ones for p + 1). */
static inline __attribute__((always_inline)) void qb_pairs(const int fmt, const uint8_t *values, int p,
                                                           __m512i q4_table, __m512bh *w0, __m512bh *w1) {
    if (fmt == QB_Q8_0) {
        for (int t = 0; t < 2; t++) {
            const int8_t *q = (const int8_t *)values + (p + t) * 32;
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
            const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
            *(t == 0 ? w0 : w1) = _mm512_cvtne2ps_pbh(b, a); /* elements 0-15 (columns 0-7) from a, 16-31 from b */
        }
        return;
    }
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(values + p / 2 * 32)));
    *w0 = (__m512bh)_mm512_permutexvar_epi16(bytes, q4_table);
    *w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), q4_table);
}

static inline __m512bh x_pair(const uint16_t *row, int64_t kp) {
    uint32_t pair;
    memcpy(&pair, row + 2 * kp, sizeof pair);
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

/* A panel block's scales d (and Q4_1 offsets m, else 0) widened to float32. */
static inline void qb_scales(const int fmt, const uint8_t *blk, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    *m = fmt == QB_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + PANEL * 2))) : _mm512_setzero_ps();
}

/* acc after one 32-input block: + d * part, then (Q4_1) + m * the row's sum of x over the block. Every
 * tile shape goes through this, in this order: a row's bits do not depend on its tile. */
static inline __m512 qb_block_step(const int with_m, __m512 acc, __m512 part, __m512 d, __m512 m, float sx) {
    const __m512 a = _mm512_fmadd_ps(d, part, acc);
    return with_m ? _mm512_fmadd_ps(m, _mm512_set1_ps(sx), a) : a;
}

/* Rows [0, mt) times panels [j0, j0 + np) of one BLOCK of columns (`wb`: its packed blocks), over all
 * of k. `sx`: the rows' per-block sums of x (Q4_1), nb per row. Per 32-input block, `part` sums x * q
 * (pairs in order); then acc += d * part (+ m * sx), acc in registers (mem = 0) or in an L1-resident
 * array (mem = 1). `prefetch`: bring the blocks ahead into L2. */
static inline __attribute__((always_inline)) void qb_tile(const int fmt, const int mt, const int np, const int mem,
                                                          const int j0, const int prefetch, const uint16_t *x,
                                                          int64_t ldx, const float *sx, const uint8_t *wb, int64_t k,
                                                          __m512i q4_table, out_rows y, int64_t n0,
                                                          int64_t n) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt), hdr = qb_header_bytes(fmt);
    __m512 acc[QB_TILE_ROWS][NB];
    float acc_mem[QB_TILE_ROWS][NB][PANEL] __attribute__((aligned(64)));
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < np; j++) {
            if (mem) _mm512_store_ps(acc_mem[i][j], _mm512_setzero_ps());
            else acc[i][j] = _mm512_setzero_ps();
        }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blocks = wb + b * NB * pb;
        const char *ahead = (const char *)(blocks + QB_PREFETCH_AHEAD * NB * pb); /* may pass the end: a hint */
        if (prefetch)
            for (int64_t off = 0; off < NB * pb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
        __m512 part[QB_TILE_ROWS][NB];
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < np; j++) part[i][j] = _mm512_setzero_ps();
        for (int p = 0; p < QPAIRS; p += 2) {
            const int64_t kp = b * QPAIRS + p;
            __m512bh w0[NB], w1[NB];
            for (int j = 0; j < np; j++) qb_pairs(fmt, blocks + (j0 + j) * pb + hdr, p, q4_table, &w0[j], &w1[j]);
            for (int i = 0; i < mt; i++) {
                const __m512bh a = x_pair(x + i * ldx, kp);
                for (int j = 0; j < np; j++) part[i][j] = _mm512_dpbf16_ps(part[i][j], a, w0[j]);
            }
            for (int i = 0; i < mt; i++) {
                const __m512bh a = x_pair(x + i * ldx, kp + 1);
                for (int j = 0; j < np; j++) part[i][j] = _mm512_dpbf16_ps(part[i][j], a, w1[j]);
            }
        }
        for (int j = 0; j < np; j++) {
            __m512 d, m;
            qb_scales(fmt, blocks + (j0 + j) * pb, &d, &m);
            for (int i = 0; i < mt; i++) {
                const float block_sx = fmt == QB_Q4_1 ? sx[i * nb + b] : 0.0f;
                const __m512 a = qb_block_step(fmt == QB_Q4_1, mem ? _mm512_load_ps(acc_mem[i][j]) : acc[i][j],
                                               part[i][j], d, m, block_sx);
                if (mem) _mm512_store_ps(acc_mem[i][j], a);
                else acc[i][j] = a;
            }
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < np && n0 + (j0 + j) * PANEL < n; j++)
            store_panel(out_at(y, i), n0 + (j0 + j) * PANEL, n, mem ? _mm512_load_ps(acc_mem[i][j]) : acc[i][j]);
}

/* A tile of R rows times one BLOCK, NP panels at a time, acc in registers (MEM 0) or memory (MEM 1):
 * one function per format and row count. */
typedef void (*qb_tile_fn)(const uint16_t *, int64_t, const float *, int, const uint8_t *, int64_t, __m512i, out_rows,
                           int64_t, int64_t);
#define QB_TILE_DEF(F, R, NP, MEM)                                                                                   \
    static __attribute__((noinline, aligned(64))) void qb_tile_##F##_##R(                                            \
        const uint16_t *x, int64_t ldx, const float *sx, int pf, const uint8_t *wb, int64_t k, __m512i t, out_rows y,   \
        int64_t n0, int64_t n) {                                                                                                                                                             \
        for (int j0 = 0; j0 < NB; j0 += NP)                                                                          \
            qb_tile(F, R, NP, MEM, j0, pf && j0 == 0, x, ldx, sx, wb, k, t, y, n0, n);                               \
    }
#define QB_Q4_SHAPES(F)                                                                                 \
    QB_TILE_DEF(F, 1, 4, 0) QB_TILE_DEF(F, 2, 4, 0) QB_TILE_DEF(F, 3, 4, 1) QB_TILE_DEF(F, 4, 4, 1) \
    QB_TILE_DEF(F, 5, 2, 0) QB_TILE_DEF(F, 6, 2, 0) QB_TILE_DEF(F, 7, 2, 1) QB_TILE_DEF(F, 8, 1, 0)
QB_Q4_SHAPES(QB_Q4_0)
QB_Q4_SHAPES(QB_Q4_1)
QB_TILE_DEF(QB_Q8_0, 1, 4, 0) QB_TILE_DEF(QB_Q8_0, 2, 4, 0) QB_TILE_DEF(QB_Q8_0, 3, 2, 0) QB_TILE_DEF(QB_Q8_0, 4, 2, 0)
QB_TILE_DEF(QB_Q8_0, 5, 1, 0) QB_TILE_DEF(QB_Q8_0, 6, 1, 0) QB_TILE_DEF(QB_Q8_0, 7, 1, 0) QB_TILE_DEF(QB_Q8_0, 8, 1, 0)
QB_TILE_DEF(QB_Q8_0, 9, 1, 0) QB_TILE_DEF(QB_Q8_0, 10, 1, 0) QB_TILE_DEF(QB_Q8_0, 11, 1, 0)
QB_TILE_DEF(QB_Q8_0, 12, 1, 0) QB_TILE_DEF(QB_Q8_0, 13, 1, 1) QB_TILE_DEF(QB_Q8_0, 14, 1, 1)
QB_TILE_DEF(QB_Q8_0, 15, 1, 1) QB_TILE_DEF(QB_Q8_0, 16, 1, 1)
#define QB_TILES_1_8(F) \
    qb_tile_##F##_1, qb_tile_##F##_2, qb_tile_##F##_3, qb_tile_##F##_4, qb_tile_##F##_5, qb_tile_##F##_6, \
        qb_tile_##F##_7, qb_tile_##F##_8
/* By rows - 1. */
static const qb_tile_fn qb_tiles_q4_0[QB_TILE_ROWS_Q4] = {QB_TILES_1_8(QB_Q4_0)};
static const qb_tile_fn qb_tiles_q4_1[QB_TILE_ROWS_Q4] = {QB_TILES_1_8(QB_Q4_1)};
static const qb_tile_fn qb_tiles_q8_0[QB_TILE_ROWS_Q8] = {
    QB_TILES_1_8(QB_Q8_0), qb_tile_QB_Q8_0_9,  qb_tile_QB_Q8_0_10, qb_tile_QB_Q8_0_11, qb_tile_QB_Q8_0_12,
    qb_tile_QB_Q8_0_13,    qb_tile_QB_Q8_0_14, qb_tile_QB_Q8_0_15, qb_tile_QB_Q8_0_16};

/* sx [m, k / 32]: each row's float32 sum of x over each 32-input block (one fixed order). */
static void qb_block_sums(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, float *sx) {
    const int64_t nb = k / QK;
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b < nb; b++) {
            const __m512i h = _mm512_loadu_si512(x + i * ldx + b * QK);
            const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1));
            const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                                             _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
            sx[i * nb + b] = _mm512_reduce_add_ps(sum);
        }
}

/* ---- Many rows: a BLOCK's q expanded once ----
 *
 * Streaming tiles each expand the q of the BLOCK they stream, so 40 rows (5 Q4 tiles) expand every
 * weight 5 times, and a Q4 tile of 8 rows feeds one panel per broadcast of x. With more than QE_MIN_ROWS_Q8
 * (Q4: QE_MIN_ROWS_Q4) rows, a thread instead expands its BLOCK once into a buffer of dpbf16 operands ([NB
 * panels][k / 2 pairs] zmm, the float path's layout: 72 KB for k = 576, L2-resident) with d and m widened to float32
 * ([k / 32][NB][16] each), then runs tiles of up to 6 rows over it, 2 panels at a time: 12 zmm of partial
 * sums and 12 of sums, all in registers, 2 weight loads and 6 broadcasts per 12 dpbf16. (4 panels at a
 * time kept the sums in an L1 array, and the block steps' loads, stores and spills cost: 0.94x
 * this over SmolLM2's linears at 256 rows on Zen 4.) Every output is the
 * same operations on the same operands in the same order as in a streaming tile (pairs in order into
 * `part`, then d, then m, blocks in order), so the same bits: a row's result still does not depend on
 * its batch. */

#define QE_TILE_ROWS 6
#define QE_PANELS 2 /* panels per pass of a tile: 12 partial sums and 12 sums in registers */
/* Fewer rows stream. Q8_0 tiles of up to 16 rows expand a vector in 5 conversions per up to 16 dpbf16,
 * and the expansion pass costs more than that up to about 64 rows: SmolLM2's lm_head (49152 x 576)
 * streamed in 0.80-0.98x the expanded path's time at 17-64 rows, 1.01x at 80 and 1.03x at 96 (Zen 4,
 * `python -m asyncpp.bench.linears_ab --formats q8_0`). Q4 tiles of 5-6 rows with their sums in
 * registers expand a vector in 2 shuffles per 10-12 dpbf16, cheaper than writing it to the buffer and
 * reading it back, up to about 100 rows: over a stage's Q4_1 linears on weights in DRAM (2 MB pages),
 * 0.90-0.97x the expanded path's time at 24-96 rows, 0.96-1.11x from 104 (Zen 4). */
#define QE_MIN_ROWS_Q8 64
#define QE_MIN_ROWS_Q4 96

struct qb_expanded {
    __m512bh *w;  /* [NB][k / 2]: panel j's operand for input pair kp at w[j * k / 2 + kp] */
    float *d, *m; /* [k / 32][NB][PANEL]: the scales (and Q4_1 offsets) as float32 */
};

/* Expand one BLOCK's packed blocks `wb` into `e`. */
static void qb_expand_block(const int fmt, const uint8_t *wb, int64_t k, __m512i q4_table, const struct qb_expanded *e) {
    const int64_t nb = k / QK, pb = qb_panel_block_bytes(fmt), hdr = qb_header_bytes(fmt), kpairs = k / 2;
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < NB; j++) {
            const uint8_t *blk = wb + (b * NB + j) * pb;
            __m512bh *w = e->w + j * kpairs + b * QPAIRS;
            for (int p = 0; p < QPAIRS; p += 2) qb_pairs(fmt, blk + hdr, p, q4_table, &w[p], &w[p + 1]);
            __m512 d, m;
            qb_scales(fmt, blk, &d, &m);
            _mm512_store_ps(e->d + (b * NB + j) * PANEL, d);
            _mm512_store_ps(e->m + (b * NB + j) * PANEL, m);
        }
}

/* Rows [0, mt) times the expanded BLOCK `e`, over all of k; `with_m`: Q4_1 (add m * sx per block).
 * `next` (NULL: none): the packed blocks of the thread's next BLOCK, `block_bytes` per 32 inputs,
 * requested into L2 meanwhile (one 32-input block per 32-input block computed), so that reading
 * memory overlaps the arithmetic as in the streaming tiles. */
static inline __attribute__((always_inline)) void qe_tile(const int with_m, const int mt, const uint16_t *x,
                                                          int64_t ldx, const float *sx, const struct qb_expanded *e,
                                                          const char *next, int64_t block_bytes, int64_t k,
                                                          out_rows y, int64_t n0, int64_t n) {
    const int64_t nb = k / QK, kpairs = k / 2;
    for (int j0 = 0; j0 < NB; j0 += QE_PANELS) {
        __m512 acc[QE_TILE_ROWS][QE_PANELS];
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < QE_PANELS; j++) acc[i][j] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (next != NULL && j0 == 0)
                for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(next + b * block_bytes + off, _MM_HINT_T1);
            __m512 part[QE_TILE_ROWS][QE_PANELS];
            for (int i = 0; i < mt; i++)
                for (int j = 0; j < QE_PANELS; j++) part[i][j] = _mm512_setzero_ps();
            for (int p = 0; p < QPAIRS; p++) {
                const int64_t kp = b * QPAIRS + p;
                __m512bh w[QE_PANELS];
                for (int j = 0; j < QE_PANELS; j++) w[j] = e->w[(j0 + j) * kpairs + kp];
                for (int i = 0; i < mt; i++) {
                    const __m512bh a = x_pair(x + i * ldx, kp);
                    for (int j = 0; j < QE_PANELS; j++) part[i][j] = _mm512_dpbf16_ps(part[i][j], a, w[j]);
                }
            }
            for (int j = 0; j < QE_PANELS; j++) {
                const __m512 d = _mm512_load_ps(e->d + (b * NB + j0 + j) * PANEL);
                const __m512 m = with_m ? _mm512_load_ps(e->m + (b * NB + j0 + j) * PANEL) : _mm512_setzero_ps();
                for (int i = 0; i < mt; i++)
                    acc[i][j] = qb_block_step(with_m, acc[i][j], part[i][j], d, m, with_m ? sx[i * nb + b] : 0.0f);
            }
        }
        for (int i = 0; i < mt; i++)
            for (int j = 0; j < QE_PANELS && n0 + (j0 + j) * PANEL < n; j++)
                store_panel(out_at(y, i), n0 + (j0 + j) * PANEL, n, acc[i][j]);
    }
}

typedef void (*qe_tile_fn)(const uint16_t *, int64_t, const float *, const struct qb_expanded *, const char *, int64_t,
                           int64_t, out_rows, int64_t, int64_t);
#define QE_TILE_DEF(M, R)                                                                                    \
    static __attribute__((noinline, aligned(64))) void qe_tile_##M##_##R(                                    \
        const uint16_t *x, int64_t ldx, const float *sx, const struct qb_expanded *e, const char *next,     \
        int64_t block_bytes, int64_t k, out_rows y, int64_t n0, int64_t n) {                                \
        qe_tile(M, R, x, ldx, sx, e, next, block_bytes, k, y, n0, n);                                        \
    }
/* More than 16 rows in near-equal tiles of at most 6 take 4 to 6 rows each (17 = 5 + 6 + 6). */
#define QE_MIN_TILE_ROWS 4
#define QE_SHAPES(M) QE_TILE_DEF(M, 4) QE_TILE_DEF(M, 5) QE_TILE_DEF(M, 6)
QE_SHAPES(0)
QE_SHAPES(1)
/* By [with_m][rows - QE_MIN_TILE_ROWS]. */
static const qe_tile_fn qe_tiles[2][QE_TILE_ROWS - QE_MIN_TILE_ROWS + 1] = {{qe_tile_0_4, qe_tile_0_5, qe_tile_0_6},
                                                                            {qe_tile_1_4, qe_tile_1_5, qe_tile_1_6}};

/* A per-thread expansion buffer for k inputs; w == NULL if it could not be allocated. */
static struct qb_expanded qb_expanded_alloc(int64_t k) {
    const size_t w_bytes = (size_t)(NB * (k / 2)) * sizeof(__m512bh), s_bytes = (size_t)(k / QK * NB * PANEL) * sizeof(float);
    struct qb_expanded e = {aligned_alloc(64, w_bytes), aligned_alloc(64, s_bytes), aligned_alloc(64, s_bytes)};
    if (e.w == NULL || e.d == NULL || e.m == NULL) {
        free(e.w), free(e.d), free(e.m);
        e = (struct qb_expanded){NULL, NULL, NULL};
    }
    return e;
}

#endif

#endif  /* ASYNCPP_BF16_BLOCKS_H */
