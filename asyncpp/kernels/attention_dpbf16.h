/* The avx512_bf16 level's decode attention for bfloat16 caches: vdpbf16ps instead of widened multiplies.
 *
 * Included by decode_attention.c (after its helpers) where the compiler targets AVX512-BF16; used for
 * bfloat16 caches whose head_dim is a multiple of 32, for every row of the call, so a row's bits never
 * depend on the rest of the batch, and, as before, every row of a deployment gets this level's
 * arithmetic (the level is chosen once per deployment, like the linears' kernels). The other levels,
 * and float32 caches, keep decode_attention.c's own.
 *
 * Arithmetic, per head (q and k as they are stored: bfloat16, multiplied exactly):
 *   score   vdpbf16ps over the head's element pairs (2i, 2i+1), i = 0 .. head_dim/2 - 1, one after
 *           the other into one float32 sum, times the scale (a tile's 16 keys transposed into a
 *           vector's lanes, so 16 keys at once and no lane sums);
 *   softmax the numerators exp(s - max) and their float32 sum as on the other levels, then the
 *           numerators rounded to bfloat16 (nearest even, in place), zero past the row's context;
 *   values  positions 2m and 2m+1 together: vdpbf16ps of the pair (v[2m][d], v[2m+1][d]) by
 *           (p[2m], p[2m+1]) in lane d's accumulator, pair after pair, times 1 / sum. A row's last
 *           position, when odd, pairs with a zero value and a zero weight, whether or not the
 *           group's other rows read a position after it.
 * vpunpck{l,h}wd interleave two value rows within 128-bit lanes, so the accumulators hold each
 * 32-element chunk's dims in the order (0-3, 8-11, 16-19, 24-27) and (4-7, 12-15, 20-23, 28-31);
 * `dp_store_row` puts them back in order.
 *
 * Per 16 keys and head, 32 vdpbf16ps (64 dims) score what 64 multiplies, 63 adds and a tree of 31
 * shuffles did (the transpose, 128 shuffles per kv head and tile, is shared by the group's rows), and
 * per two positions 4 vdpbf16ps sum what 8 multiplies and 8 adds did, with no widening: `python -m
 * asyncpp.bench.attention --baseline OLD.c` times the change.
 */

#include <immintrin.h>

/* Row r's raw bfloat16 query (all heads) into its scratch, its sums to zero, its maxima to the lowest. */
static inline void dp_start_row(const struct layer *L, const struct row *r, const struct scratch *S, int64_t num_heads,
                                int chunks) {
    memcpy(S->q, r->q, (size_t)(num_heads * L->head_bytes));
    for (int64_t h = 0; h < num_heads; h++) {
        for (int c = 0; c < chunks; c++) S->acc[h * chunks + c] = ZERO;
        S->max_score[h] = ZERO - FLT_MAX;
    }
}

/* _mm512_dpbf16_ps(acc, b, the 32-bit word at p in every lane), the word read by the instruction itself
 * ({1to16}): GCC keeps a separate vpbroadcastd, one more uop per vdpbf16ps where each takes a word of its
 * own (a register-resident loop of 12 sums: 101 GMAC/s, 115 with it, Zen 4). The same operation. */
static inline __attribute__((always_inline)) __m512 dp_bcast(__m512 acc, __m512bh b, const void *p) {
    __asm__("vdpbf16ps %[w]%{1to16%}, %[b], %[acc]" : [acc] "+v"(acc) : [b] "v"(b), [w] "m"(*(const uint32_t *)p));
    return acc;
}

/* The 16x16 32-bit words r[k][e] -> r[e][k] (unpacks within 128-bit lanes, then 128-bit lane shuffles). */
static inline void dp_transpose16(__m512i r[LANES]) {
    __m512i t[LANES], u[LANES];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + m], lane L: word 4L + m of rows 4i .. 4i + 3 */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int m = 0; m < 4; m++) {
        const __m512i a01 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), b01 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i a23 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE), b23 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(a01, b01, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(a23, b23, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
    }
}

/* One kv head's part of a tile's n_max keys by word (a word: a bfloat16 pair): kt[w] lane k is word w of
 * key k (zero past n_max). */
static inline __attribute__((always_inline)) void dp_keys_by_word(const char *k_head, const int64_t off[LANES],
                                                                  int n_max, const int words, __m512i *kt) {
    for (int b = 0; b < words; b += LANES) {
        __m512i r[LANES];
        for (int k = 0; k < LANES; k++)
            r[k] = k < n_max ? _mm512_loadu_si512(k_head + off[k] + b * 4) : _mm512_setzero_si512();
        dp_transpose16(r);
        for (int e = 0; e < LANES; e++) kt[b + e] = r[e];
    }
}

/* score_tile_rows by vdpbf16ps over a tile's keys by word (`dp_keys_by_word`): row r's `group` bfloat16
 * query heads at q[r], n[r] of the tile's keys valid for it (n[r] <= 0: none, its scores are left
 * alone). Each (row, head) is one chain of `words` vdpbf16ps, the rows' chains side by side. */
static inline __attribute__((always_inline)) void dp_score_tile_rows(
    const char *const q[GROUP_ROWS], const __m512i *kt, const int n[GROUP_ROWS], float scale,
    float *const scores[GROUP_ROWS], int64_t stride, f32x16 *const max_score[GROUP_ROWS], const int nr,
    const int group, const int words) {
    const int64_t head_bytes = (int64_t)words * 4;
    __m512 s[GROUP_ROWS][MAX_GROUP];
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++) s[r][g] = _mm512_setzero_ps();
    for (int w = 0; w < words; w++)
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < group; g++) s[r][g] = dp_bcast(s[r][g], (__m512bh)kt[w], q[r] + g * head_bytes + w * 4);
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group && n[r] > 0; g++)
            keep_scores(scores[r] + g * stride, (f32x16)s[r][g] * scale, &max_score[r][g], n[r]);
}

/* A head's ctx softmax numerators (float32, at p) rounded to bfloat16 in place (p[0 .. ctx) as uint16),
 * then zeros up to the next multiple of 16: 16 at a time, each written below what is still to read. */
static inline void dp_round_weights(float *p, int64_t ctx) {
    uint16_t *w = (uint16_t *)p;
    for (int64_t pos = 0; pos < ctx; pos += LANES) {
        const __mmask16 valid = ctx - pos >= LANES ? 0xFFFF : (__mmask16)((1u << (ctx - pos)) - 1);
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, p + pos));
        _mm256_storeu_si256((__m256i *)(w + pos), (__m256i)h);
    }
}

/* value_tile_pair by vdpbf16ps for the nr (1 or 2) rows `rows` of a pair, over their tiles [t0, t1) of one
 * kv head, two positions at a time: row r's weights (bfloat16 pairs as 32-bit words) for head g at
 * w[r] + g * wstride + m (pair m of its context); acc in dp_store_row's order. The sums stay in registers
 * from tile t0 to t1 - 1. The K slots of `next` (NULL: none) for this kv head are requested meanwhile,
 * tile by tile. */
static inline __attribute__((always_inline)) void dp_value_rows(
    const struct layer *L, const struct row *rows, int64_t t0, int64_t t1, const struct row *next, int64_t kvh,
    const uint32_t *const w[2], int64_t wstride, f32x16 *const acc[2], const int nr, const int group, const int pairs) {
    const int64_t head_bytes = (int64_t)pairs * 64, pf_head = kvh * L->head_bytes;
    const int chunks = 2 * pairs;
    const char *v_head = L->v_cache + pf_head;
    int64_t tiles[2];
    const int64_t ctx_max = group_tiles(rows, nr, tiles), tiles_max = (ctx_max + LANES - 1) / LANES;
    const int64_t last = t1 < tiles_max ? t1 : tiles_max;
    const int64_t next_tiles = next ? (next->ctx + LANES - 1) / LANES : 0;
    int64_t off[LANES], next_off[LANES];
    __m512 a[2][MAX_GROUP][MAX_CHUNKS];
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) a[r][g][c] = (__m512)acc[r][g * chunks + c];
/* Row r's weights for positions j, j + 1 of tile t times the value pairs P into its sums. */
#define DP_VALUE_ROW(r, P)                                                                          \
    for (int g = 0; g < group; g++) {                                                               \
        uint32_t word;                                                                              \
        memcpy(&word, w[r] + g * wstride + t * LANES / 2 + j / 2, sizeof word);                     \
        const __m512bh wg = (__m512bh)_mm512_set1_epi32((int)word);                                 \
        for (int c = 0; c < chunks; c++) a[r][g][c] = _mm512_dpbf16_ps(a[r][g][c], (P)[c], wg);     \
    }
    for (int64_t t = t0; t < last; t++) {
        int n[2] = {0, 0};
        const int n_max = group_tile(L, rows, nr, tiles, ctx_max, t, off, n);
        const struct ahead pf = {L->k_cache, next_off, t < next_tiles ? tile_size(next->ctx, t) : 0};
        if (pf.n) tile_offsets(L, next->blocks, t, pf.n, next_off);
        for (int j = 0; j < n_max; j += 2) {
            if (j < pf.n) prefetch(pf.base + pf.off[j] + pf_head, head_bytes);
            if (j + 1 < pf.n) prefetch(pf.base + pf.off[j + 1] + pf_head, head_bytes);
            const int second = j + 1 < n_max; /* a value at position j + 1 for some row */
            __m512i v0[MAX_CHUNKS / 2];
            __m512bh p[MAX_CHUNKS];
            for (int c = 0; c < pairs; c++) {
                v0[c] = _mm512_loadu_si512(v_head + off[j] + c * 64);
                const __m512i v1 = second ? _mm512_loadu_si512(v_head + off[j + 1] + c * 64) : _mm512_setzero_si512();
                p[2 * c] = (__m512bh)_mm512_unpacklo_epi16(v0[c], v1);
                p[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(v0[c], v1);
            }
            int any_alone = 0; /* rows whose last position is j while another row's value at j + 1 is in p */
            for (int r = 0; r < nr; r++) {
                if (j >= n[r] || (second && n[r] == j + 1)) {
                    any_alone |= j < n[r];
                    continue;
                }
                DP_VALUE_ROW(r, p);
            }
            if (any_alone) { /* their position j with a zero value after it, as when computed alone */
                for (int c = 0; c < pairs; c++) {
                    p[2 * c] = (__m512bh)_mm512_unpacklo_epi16(v0[c], _mm512_setzero_si512());
                    p[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(v0[c], _mm512_setzero_si512());
                }
                for (int r = 0; r < nr; r++)
                    if (n[r] == j + 1) DP_VALUE_ROW(r, p);
            }
        }
        for (int j = n_max + (n_max & 1); j < pf.n; j++) prefetch(pf.base + pf.off[j] + pf_head, head_bytes);
    }
#undef DP_VALUE_ROW
    for (int r = 0; r < nr; r++)
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) acc[r][g * chunks + c] = (f32x16)a[r][g][c];
}

/* Row r's output: each head's sums back in dim order, times 1 / its softmax sum. */
static inline void dp_store_row(const struct layer *L, const struct row *r, const struct scratch *S, int64_t num_heads,
                                int chunks) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t h = 0; h < num_heads; h++) {
        const float inv = 1.0f / S->denom[h];
        for (int c = 0; c < chunks; c += 2) {
            const __m512 lo = (__m512)S->acc[h * chunks + c], hi = (__m512)S->acc[h * chunks + c + 1];
            store16(r->out + h * L->head_bytes, c * LANES, L->dtype, (f32x16)_mm512_permutex2var_ps(lo, first, hi) * inv);
            store16(r->out + h * L->head_bytes, (c + 1) * LANES, L->dtype,
                    (f32x16)_mm512_permutex2var_ps(lo, second, hi) * inv);
        }
    }
}

/* Rows of one request taken together: the keys of a tile are transposed once for all of them. */
#define DP_ROWS 16

/* attend_group with this arithmetic, for the nr (1..DP_ROWS) rows r[] of one request. */
static inline __attribute__((always_inline)) void dp_attend(const struct layer *L, const struct row *r, int nr,
                                                            const struct row *next, const struct scratch *S,
                                                            const int group, const int chunks) {
    const int pairs = chunks / 2, words = pairs * LANES;
    const int64_t num_heads = L->num_kv_heads * group;
    int64_t tiles[DP_ROWS];
    for (int i = 0; i < nr; i++) dp_start_row(L, &r[i], &S[i], num_heads, chunks);
    const int64_t ctx_max = group_tiles(r, nr, tiles);
    const int64_t tiles_max = (ctx_max + LANES - 1) / LANES, next_tiles = next ? (next->ctx + LANES - 1) / LANES : 0;
    int64_t off[LANES];
    int n[DP_ROWS];
    /* Pass 1: scores, the tile's keys transposed once for all rows; its V slots are requested for pass 2. */
    for (int64_t t = 0; t < tiles_max; t++) {
        const int n_max = group_tile(L, r, nr, tiles, ctx_max, t, off, n);
        if (t + GROUP_KEYS_AHEAD < tiles_max) prefetch_keys(L, &r[0], t + GROUP_KEYS_AHEAD, t + GROUP_KEYS_AHEAD + 1);
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++) {
            for (int j = 0; j < n_max; j++) prefetch(L->v_cache + off[j] + kvh * L->head_bytes, L->head_bytes);
            __m512i kt[MAX_CHUNKS * LANES / 2];
            dp_keys_by_word(L->k_cache + kvh * L->head_bytes, off, n_max, words, kt);
            for (int i0 = 0; i0 < nr; i0 += GROUP_ROWS) {
                const int sub = nr - i0 < GROUP_ROWS ? nr - i0 : GROUP_ROWS;
                const char *q[GROUP_ROWS] = {0};
                float *scores[GROUP_ROWS] = {0};
                f32x16 *max_score[GROUP_ROWS] = {0};
                for (int i = 0; i < sub; i++) {
                    q[i] = (const char *)S[i0 + i].q + kvh * group * L->head_bytes;
                    scores[i] = S[i0 + i].scores + kvh * group * S[i0 + i].stride + t * LANES;
                    max_score[i] = S[i0 + i].max_score + kvh * group;
                }
#define DP_SCORE(NR) dp_score_tile_rows(q, kt, n + i0, L->scale, scores, S[0].stride, max_score, NR, group, words)
                if (sub == 1) /* a constant row count keeps the loops over rows unrolled */
                    DP_SCORE(1);
                else if (sub == 2)
                    DP_SCORE(2);
                else if (sub == 3)
                    DP_SCORE(3);
                else
                    DP_SCORE(4);
#undef DP_SCORE
            }
        }
    }
    for (int i = 0; i < nr; i++)
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++) {
            float *scores = S[i].scores + kvh * group * S[i].stride;
            softmax_group(scores, S[i].stride, r[i].ctx, S[i].max_score + kvh * group, S[i].denom + kvh * group, group);
            for (int g = 0; g < group; g++) dp_round_weights(scores + g * S[i].stride, r[i].ctx);
        }
    /* Pass 2: the weighted sums of values, two rows at a time. One pair: tile by tile, each tile's slots for
     * all kv heads together (decode rows: the slots come from memory). More: each pair through all its
     * tiles of a kv head, its sums in registers throughout (a tile's sums of 16 rows did not stay in L1).
     * The last pair requests the next row's K slots. */
    const int64_t steps = nr > 2 ? 1 : tiles_max, step_tiles = nr > 2 ? tiles_max : 1;
    for (int64_t step = 0; step < steps; step++)
        for (int64_t kvh = 0; kvh < L->num_kv_heads; kvh++)
            for (int i = 0; i < nr; i += 2) {
                const int pair = nr - i < 2 ? nr - i : 2;
                const int64_t t0 = step * step_tiles;
                /* a head's bfloat16 weights fill the first half of its row of floats: word m of tile t at t * 8 + m */
                const uint32_t *w[2] = {(const uint32_t *)(S[i].scores + kvh * group * S[i].stride),
                                        pair > 1 ? (const uint32_t *)(S[i + 1].scores + kvh * group * S[i + 1].stride)
                                                 : NULL};
                f32x16 *acc[2] = {S[i].acc + kvh * group * chunks, pair > 1 ? S[i + 1].acc + kvh * group * chunks : NULL};
                const struct row *ahead = i + pair == nr ? next : NULL;
                if (pair == 2) /* constant: the accumulators stay in registers */
                    dp_value_rows(L, &r[i], t0, t0 + step_tiles, ahead, kvh, w, S[i].stride, acc, 2, group, pairs);
                else
                    dp_value_rows(L, &r[i], t0, t0 + step_tiles, ahead, kvh, w, S[i].stride, acc, 1, group, pairs);
            }
    if (tiles_max < next_tiles) prefetch_keys(L, next, tiles_max, next_tiles);
    for (int i = 0; i < nr; i++) dp_store_row(L, &r[i], &S[i], num_heads, chunks);
}

GROUP_SHAPES(dp_attend) /* dp_attend_any */
